/* ---------------------------------------------------------------------------
   Communication: parameters on every device, splitting a batch, allreduce
   ---------------------------------------------------------------------------
   Data parallelism needs three things: a copy of the parameters on every
   device, each device's share of the batch, and, after each backward pass,
   the sum of every device's gradients on every device (an allreduce).

   The book's functions.
       mgpu_param p[4];  mgpu_get_params(p, params, 4, dev);
   copies each of params[0..3] to dev, each with a zero gradient of the same
   shape (p[k].value, p[k].grad); mgpu_params_free(p, 4) frees them.
       mgpu_allreduce(grads, n);
   the book's allreduce: adds grads[1..n-1] into grads[0] (copying each to
   grads[0]'s device first), then copies the sum back to every device.
       mgpu_scatter(x, devices, n, out);
   splits x along dimension 0 as PyTorch's nn.parallel.scatter does: chunks
   of ceil(N/n) rows, the last one shorter, out[i] a new tensor on
   devices[i]. A device that would get no rows (4 rows on 3 devices: 2, 2
   and nothing) is an error. mgpu_split_batch does it for the images X and
   the labels y, which must have the same number of rows. The copies are
   non-blocking (the batch usually sits in pinned host memory).

   The ring allreduce. The book's version moves everything through device
   0: with n devices of N bytes each, device 0 receives and sends (n-1)N
   bytes while the others wait. A ring cuts each vector into n chunks and
   lets every device send and receive at once:
     reduce-scatter, n-1 steps: at step s device i sends its chunk
       (i - s) mod n to device i+1, which adds it to its own copy of that
       chunk. After n-1 steps device i holds the full sum of chunk (i+1).
     all-gather, n-1 steps: at step s device i sends the finished chunk
       (i + 1 - s) mod n to device i+1, which keeps it.
   Each device sends 2(n-1)/n N bytes in all, whatever n is: this is the
   "bus bandwidth" factor 2(n-1)/n of nccl-tests. Any length works (a
   vector shorter than n leaves some chunks empty).
       mgpu_ring_allreduce(grads, n, average);   average: divide by n
   The ring runs on each device's communication queue (its copy queue: a
   CUDA stream, or a worker thread on the CPU), so it can run while the
   compute queue goes on with other work; the adds are kernels on that
   queue. mgpu_ring_allreduce makes each compute queue wait for the result,
   so the next operation on grads[i] sees the sum.

   NCCL. Between distinct physical GPUs, NVIDIA's NCCL does the same job
   over NVLink or PCIe with tuned kernels. In one process:
       mgpu_nccl_comm *c = mgpu_nccl_init(devices, n);
   returns NULL when the devices are not n distinct GPUs (virtual devices
   share a GPU, and NCCL before 2.30 refuses two ranks on one GPU; CPU
   devices have no NCCL; nor does a build without nvcc). Then
       mgpu_nccl_allreduce(c, data, average)      data[i] on GPU i of c
       mgpu_nccl_broadcast(c, data, root)         data[root] to all
       mgpu_nccl_reduce_scatter(c, in, out, average)  out[i] = chunk i of the sum;
                                                  in[i] has n times out[i]'s elements
       mgpu_nccl_all_gather(c, in, out)           out[i] = in[0], in[1], ... in a row
       mgpu_nccl_free(c)
   run on the communication queues too; the compute queues wait for them.

   Choosing. mgpu_allreduce_auto(data, n, average) uses NCCL when the
   devices are distinct GPUs, the ring otherwise, and nothing for one
   device; it returns the name of what it used: "nccl", "ring" or "none".

   Overlap. mgpu_allreduce_start(data, n, average, scratch) is
   mgpu_allreduce_auto without its last step: the reduction is queued on
   the communication queues (each starts when its compute queue has
   produced data[i]) and the compute queues go on at once;
   mgpu_comm_wait(devices, n) then makes each compute queue wait for
   everything given to its communication queue so far. In between, leave
   data[i] alone: it is being reduced.
       backward of the last layers ...
       mgpu_allreduce_start(bucket, n, 0, scratch);  their reduction starts
       backward of the earlier layers ...             runs meanwhile
       mgpu_comm_wait(devices, n);                    the optimiser sees every sum
   A bucket is one flat tensor per device (gradients can be views into
   it). scratch is NULL, or the ring's receive buffers: one per device, on
   that device, of at least ceil(numel / n) elements, kept from call to
   call and freed after mgpu_comm_wait. Why keep them: memory the ring
   takes from the allocator goes back marked "in use until this reduction
   ends", and the next tensor of that size would make its compute queue
   wait for the reduction, stalling the backward pass the overlap is for.

   Peer access. Two GPUs copy straight to each other (NVLink or PCIe)
   only once peer access is on; otherwise the driver stages every copy
   through host memory. mgpu_enable_peer_access(devices, n) turns it on
   for every pair that can; the ring and the book's allreduce call it.

   Errors: tensors of different shapes, devices of mixed kinds in a ring,
   or more than MGPU_MAX_DEVICES tensors are one-line errors naming the
   function; NCCL failures name the file, line and NCCL's message. */

typedef struct mgpu_param { mgpu_tensor *value, *grad; } mgpu_param;
MGPU_DEF void mgpu_get_params(mgpu_param *out, mgpu_tensor *const *params, int n, mgpu_device *dev);
MGPU_DEF void mgpu_params_free(mgpu_param *p, int n);

MGPU_DEF void mgpu_allreduce(mgpu_tensor **data, int n);
MGPU_DEF void mgpu_scatter(const mgpu_tensor *x, mgpu_device *const *devices, int n, mgpu_tensor **out);
MGPU_DEF void mgpu_split_batch(const mgpu_tensor *X, const mgpu_tensor *y, mgpu_device *const *devices,
                               int n, mgpu_tensor **X_shards, mgpu_tensor **y_shards);

MGPU_DEF void mgpu_ring_allreduce(mgpu_tensor **data, int n, int average);
MGPU_DEF void mgpu_enable_peer_access(mgpu_device *const *devices, int n);

typedef struct mgpu_nccl_comm mgpu_nccl_comm;
MGPU_DEF mgpu_nccl_comm *mgpu_nccl_init(mgpu_device *const *devices, int n);
MGPU_DEF void mgpu_nccl_free(mgpu_nccl_comm *comm);
MGPU_DEF void mgpu_nccl_allreduce(mgpu_nccl_comm *comm, mgpu_tensor **data, int average);
MGPU_DEF void mgpu_nccl_broadcast(mgpu_nccl_comm *comm, mgpu_tensor **data, int root);
MGPU_DEF void mgpu_nccl_reduce_scatter(mgpu_nccl_comm *comm, mgpu_tensor *const *in, mgpu_tensor **out,
                                       int average);
MGPU_DEF void mgpu_nccl_all_gather(mgpu_nccl_comm *comm, mgpu_tensor *const *in, mgpu_tensor **out);

MGPU_DEF const char *mgpu_allreduce_auto(mgpu_tensor **data, int n, int average);
MGPU_DEF const char *mgpu_allreduce_start(mgpu_tensor **data, int n, int average,
                                          mgpu_tensor *const *scratch);
MGPU_DEF void mgpu_comm_wait(mgpu_device *const *devices, int n);
