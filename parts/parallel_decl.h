/* ---------------------------------------------------- data parallelism
   mgpu_data_parallel is the library's nn.DataParallel: one replica of a
   network per device; each step scatters the batch (ceil(N/k) rows each),
   runs forward and backward on every device's queue at the same time,
   combines the gradients and updates, so the replicas stay identical.

       mgpu_data_parallel *mgpu_data_parallel_new(mgpu_net *net, mgpu_device *const *devices,
                                                  int n, mgpu_dp_mode mode);
   net must live on devices[0]; it becomes replica 0 (the seed's `.module`,
   mgpu_data_parallel_module) and the wrapper copies it to the others.
   Two ways to combine the gradients:
     MGPU_DP_GATHER     what torch.nn.DataParallel does: every step the
                        parameters are broadcast from device 0, the logits
                        gathered on device 0 for the loss, and every
                        replica's gradients summed into device 0, which
                        alone runs the optimiser. Device 0 holds the full
                        batch's logits and a staging copy of every other
                        device's gradients: it needs more memory than the
                        others.
     MGPU_DP_ALLREDUCE  what DistributedDataParallel does: the gradients are
                        allreduced (NCCL between distinct GPUs, else the
                        ring), every replica runs the same SGD step, and no
                        device carries more than the others.
   Batch norm uses each device's own shard statistics (as PyTorch's
   DataParallel does); the running statistics used for evaluation are
   device 0's, updated from device 0's shard only.

       void mgpu_data_parallel_step(dp, X, y, lr, momentum, weight_decay);
   one SGD step on the mean cross-entropy of the whole batch X [N,...],
   y [N] (on any device; usually pinned host memory from the loader).
       void mgpu_data_parallel_take_stats(dp, &loss_sum, &correct);
   the summed loss and the number of right predictions of the steps since
   the last call (this waits for them), as the book's training loops count.
       const char *mgpu_data_parallel_algorithm(dp);  "gather", "ring", "nccl", "none" */
typedef enum { MGPU_DP_GATHER, MGPU_DP_ALLREDUCE } mgpu_dp_mode;
typedef struct mgpu_data_parallel mgpu_data_parallel;
MGPU_DEF mgpu_data_parallel *mgpu_data_parallel_new(mgpu_net *net, mgpu_device *const *devices,
                                                    int n, mgpu_dp_mode mode);
MGPU_DEF mgpu_net *mgpu_data_parallel_module(mgpu_data_parallel *dp);
MGPU_DEF mgpu_net *mgpu_data_parallel_replica(mgpu_data_parallel *dp, int i);
MGPU_DEF void mgpu_data_parallel_step(mgpu_data_parallel *dp, const mgpu_tensor *X,
                                      const mgpu_tensor *y, float lr, float momentum,
                                      float weight_decay);
MGPU_DEF void mgpu_data_parallel_take_stats(mgpu_data_parallel *dp, double *loss_sum,
                                            double *correct);
MGPU_DEF const char *mgpu_data_parallel_algorithm(const mgpu_data_parallel *dp);
MGPU_DEF void mgpu_data_parallel_free(mgpu_data_parallel *dp);
