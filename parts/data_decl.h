/* ---------------------------------------------------------------------------
   Data: Fashion-MNIST in memory, and batches prepared ahead
   ---------------------------------------------------------------------------
   The whole data set is read into host memory once (47 MB of pixels for
   the training set, a fraction of a second). A loader then cuts it into
   batches, the way the book's load_data_fashion_mnist(batch_size) does
   with two DataLoaders: the training loader reshuffles every epoch and the
   test loader goes in order.

   Where the files are. mgpu_data_dir(flag) picks the folder: the --data
   flag when given (non-NULL), else $MGPU_DATA, else data/fashion-mnist
   (which `make data` fills). In it, each file is looked up as
   train-images-idx3-ubyte.gz or, uncompressed, train-images-idx3-ubyte.

       mgpu_dataset *train, *test;
       mgpu_dataset_load_fashion_mnist(mgpu_data_dir(flag_data), &train, &test);
       printf("%d images of %dx%d, the first is a %s\n", train->n, train->rows,
              train->cols, mgpu_fashion_mnist_label(train->labels[0]));

   The files are in IDX format (big-endian 32-bit header words, then one
   byte per pixel or label), gzip-compressed or not: zlib reads both and
   tells them apart by the gzip magic number. Everything is checked: the
   magic numbers, the sizes, that the file holds exactly what its header
   announces (no more, no less), labels in 0..9, as many labels as images.
   Bad input stops the program with one line naming the file and the
   problem, for example
       mgpu: error: data/fashion-mnist/t10k-labels-idx1-ubyte.gz: label 12 of sample 17 is not in 0..9

   A data set is plain data that a program may also build itself (images
   and labels from malloc, so mgpu_dataset_free frees them):
       n images of rows x cols bytes, one after the other; n labels.
   mgpu_dataset_subset(d, n) copies the first n samples, in order (all of
   them when n >= d->n): the reduced runs without a GPU train on these.

   Loaders: batches prepared ahead. A loader owns a thread that copies the
   samples of the next batches, converted to floats, into pinned host
   tensors while the program computes on the current one, so that neither
   waits for the other (DataLoader's num_workers and pin_memory):
       mgpu_loader *it = mgpu_loader_new(train, 256, 1, seed);   shuffled
       for (int epoch = 0; epoch < epochs; epoch++) {
           mgpu_loader_start_epoch(it, epoch);
           mgpu_batch b;
           while (mgpu_loader_next(it, &b)) {
               ... b.x: [b.n, 1, rows, cols], pixels / 255 in [0, 1] (ToTensor)
               ... b.y: [b.n], the labels as floats (0. to 9.)
           }
       }
       mgpu_loader_free(it);
   - Order: a shuffling loader visits the samples in an order that depends
     only on (seed, epoch): the same pair gives the same order whatever
     happened before, another epoch gives another one. It is a Fisher-Yates
     shuffle driven by Philox (section 5). Without shuffling, the order is
     the data set's, every epoch.
   - Every sample once per epoch: the last batch holds what is left (60000
     samples in batches of 256 end with a batch of 96), as DataLoader's
     default drop_last=False. mgpu_loader_num_batches gives the count.
   - The batch's tensors live on the host (device mgpu_cpu(), pinned, so a
     non-blocking mgpu_copy or mgpu_to onto a GPU overlaps compute). They
     belong to the loader: do not free them. A batch stays valid until the
     next call of mgpu_loader_next, mgpu_loader_start_epoch or
     mgpu_loader_free, and work enqueued on it before that call is safe:
     the loader waits for copies of the batch (or of views of it) and for
     operations on mgpu_cpu() that read it before it reuses the memory.
     Views you take of a batch (mgpu_narrow, to scatter it) are yours to
     free; they show other data once the batch is reused.
   - A full batch is one of the loader's buffers itself; the shorter last
     batch is an mgpu_narrow view of its first b.n rows, so every batch's
     shape tells its true size.
   - mgpu_loader_start_epoch may be called at any time, also in the middle
     of an epoch (the rest of that epoch is dropped), and mgpu_loader_free
     too: the thread stops cleanly.
   The data set must outlive its loaders. */
typedef struct mgpu_dataset {
    int n, rows, cols;
    unsigned char *images; /* n * rows * cols bytes, row-major, image after image */
    unsigned char *labels; /* n labels, each in 0..9 */
} mgpu_dataset;

typedef struct mgpu_loader mgpu_loader;
typedef struct mgpu_batch {
    mgpu_tensor *x; /* [n, 1, rows, cols] pinned host memory, pixels / 255 in [0, 1] */
    mgpu_tensor *y; /* [n] the labels, as floats */
    int n;          /* samples in this batch */
} mgpu_batch;

/* The data folder: flag_dir if non-NULL, else $MGPU_DATA, else "data/fashion-mnist". */
MGPU_DEF const char *mgpu_data_dir(const char *flag_dir);
/* Reads an IDX image file and an IDX label file (each gzip-compressed or not). */
MGPU_DEF mgpu_dataset *mgpu_dataset_load(const char *images_path, const char *labels_path);
/* Reads Fashion-MNIST's four files from dir (NULL: mgpu_data_dir(NULL));
   a NULL train or test skips that part. */
MGPU_DEF void mgpu_dataset_load_fashion_mnist(const char *dir, mgpu_dataset **train,
                                              mgpu_dataset **test);
/* A copy of the first n samples (all of them when n >= d->n). */
MGPU_DEF mgpu_dataset *mgpu_dataset_subset(const mgpu_dataset *d, int n);
MGPU_DEF void mgpu_dataset_free(mgpu_dataset *d);
/* "T-shirt/top", "Trouser", ..., "Ankle boot" for k = 0..9. */
MGPU_DEF const char *mgpu_fashion_mnist_label(int k);

MGPU_DEF mgpu_loader *mgpu_loader_new(const mgpu_dataset *d, int batch_size, int shuffle,
                                      uint64_t seed);
/* Starts (or restarts) an epoch; shuffled in an order that depends only on (seed, epoch). */
MGPU_DEF void mgpu_loader_start_epoch(mgpu_loader *l, int epoch);
/* 1 and the next batch in *out, or 0 at the end of the epoch. */
MGPU_DEF int mgpu_loader_next(mgpu_loader *l, mgpu_batch *out);
MGPU_DEF int mgpu_loader_num_batches(const mgpu_loader *l);
MGPU_DEF void mgpu_loader_free(mgpu_loader *l);
