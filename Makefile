# mgpu: build the chapters, the tests and the benchmarks.
#
#   make chapter1 && ./chapter1     (chapter2, chapter3 likewise)
#   make test                       everything that needs no GPU (the GPU tests on
#                                   emulated GPUs too); ends "N passed, N failed"
#   make test-long                  what make test leaves out to fit in 10 minutes
#                                   on 2 cores: nvcc's builds, the long emulated
#                                   tests, the GPU check's rehearsal (CI runs both)
#   make test-gpu                   the same, plus CUDA against CPU (on a GPU machine)
#   make test-asan                  the CPU tests under Address/UndefinedBehaviorSanitizer
#   make bench                      the chapters' workloads beside PyTorch (GPU machine)
#   make data                       fill data/fashion-mnist/
#
# With nvcc (found by compiling a tiny CUDA file, not by asking the package
# manager) every program carries both backends: it runs on the GPUs when
# there are some and on the CPU otherwise. Without nvcc, gcc builds the CPU
# backend alone. Variables you may set: CUDA_HOME, NCCL_HOME, CUDA_ARCHS,
# NVCC, CC, MGPU_DATA, USE_CUDA=0 (force the CPU-only build), CUDNN_HOME,
# USE_CUDNN=0, USE_OPENMP=0, USE_ONEDNN=0, USE_MPI=0 (below).

CC         ?= gcc
CUDA_HOME  ?= /usr/local/cuda
# On every core unless told otherwise: a -j on the command line wins.
NPROC      := $(shell nproc 2>/dev/null || echo 1)
MAKEFLAGS  += -j$(NPROC)
# NCCL: beside the CUDA toolkit, else the nvidia-nccl package that PyTorch
# installs (as on the GPU machine), else the toolkit's folder anyway.
PY_SITE    := $(shell python3 -c 'import site; print(site.getsitepackages()[0])' 2>/dev/null)
NCCL_HOME  ?= $(patsubst %/include/nccl.h,%,$(firstword $(wildcard $(CUDA_HOME)/include/nccl.h \
                $(PY_SITE)/nvidia/nccl/include/nccl.h $(PY_SITE)/nvidia/*/include/nccl.h) \
                $(CUDA_HOME)/include/nccl.h))
# cuDNN (optional: its convolutions join the GPU's candidates,
# kernels/conv_cudnn.h): found as NCCL is, beside the toolkit or in
# PyTorch's nvidia-cudnn package. USE_CUDNN=0 leaves it out.
CUDNN_HOME ?= $(patsubst %/include/cudnn.h,%,$(firstword $(wildcard $(CUDA_HOME)/include/cudnn.h \
                $(PY_SITE)/nvidia/cudnn/include/cudnn.h $(PY_SITE)/nvidia/*/include/cudnn.h)))
WITH_CUDNN  = $(if $(filter 0,$(USE_CUDNN)),,$(CUDNN_HOME))
CUDNN       = $(if $(WITH_CUDNN),-DMGPU_CUDNN=1 -I$(CUDNN_HOME)/include)
# (pip's cuDNN, like its NCCL, ships libcudnn.so.9 without the plain link)
CUDNN_LIB   = $(if $(WITH_CUDNN),-L$(CUDNN_HOME)/lib -L$(CUDNN_HOME)/lib64 -Xlinker -rpath$(COMMA)$(CUDNN_HOME)/lib \
              $(if $(wildcard $(CUDNN_HOME)/lib/libcudnn.so $(CUDNN_HOME)/lib64/libcudnn.so),-lcudnn,-l:libcudnn.so.9))
NVCC       ?= $(CUDA_HOME)/bin/nvcc
CUDA_ARCHS ?= 80 90
BUILD      := build

# The data set: the --data flag, then $MGPU_DATA, then data/fashion-mnist.
# For the tests, fall back to the shared copy beside the checkout.
ifndef MGPU_DATA
MGPU_DATA := $(patsubst %/,%,$(dir $(firstword $(wildcard data/fashion-mnist/train-images-idx3-ubyte*) \
                                               $(wildcard ../shared/fashion-mnist/train-images-idx3-ubyte*))))
endif
export MGPU_DATA

# OpenMP. With -fopenmp a CPU device runs its own kernels on its share of
# the cores (mgpu.h, "Queues"); without it, on one thread each. It comes
# with OpenBLAS built for OpenMP (Debian's libopenblas0-openmp, which `make
# deps` installs when run as root): the products then run on the same
# threads as the kernels. Beside the default OpenBLAS, whose own threads
# spin between products, OpenMP's threads and OpenBLAS's would take each
# other's cores (bench/RESULTS.md), so without that package the kernels
# stay on one thread. USE_OPENMP=0 leaves OpenMP out.
OPENBLAS_OPENMP := /usr/lib/$(shell $(CC) -dumpmachine)/openblas-openmp
# (asked of the shell, not $(wildcard): make would remember the folder as
# it was before `make deps` installed the package)
WITH_OPENMP = $(if $(filter 0,$(USE_OPENMP)),,$(shell test -e $(OPENBLAS_OPENMP)/libopenblas.so && echo yes))
OPENMP     = $(if $(WITH_OPENMP),-fopenmp)
BLAS_DIR   = $(if $(WITH_OPENMP),$(OPENBLAS_OPENMP))
# oneDNN (Debian's libdnnl-dev, installed like OpenBLAS for OpenMP): its
# convolutions are a CPU device's candidates beside im2col
# (kernels/conv_onednn.h). It runs on OpenMP, so it comes with it.
# USE_ONEDNN=0 leaves it out.
WITH_ONEDNN = $(if $(filter 0,$(USE_ONEDNN)),,$(if $(WITH_OPENMP),$(shell test -e /usr/include/oneapi/dnnl/dnnl.h && echo yes)))
ONEDNN     = $(if $(WITH_ONEDNN),-DMGPU_ONEDNN=1)
ONEDNN_LIB = $(if $(WITH_ONEDNN),-ldnnl)
# MPI (Open MPI: Debian's libopenmpi-dev and openmpi-bin, which `make deps`
# installs when run as root): processes as a group, for chapter 4 (mgpu.h's
# DISTRIBUTED section). Found by asking mpicc for its flags; without it a
# program is a group of one. USE_MPI=0 leaves it out.
WITH_MPI   = $(if $(filter 0,$(USE_MPI)),,$(shell mpicc --showme:compile >/dev/null 2>&1 && echo yes))
MPI_FLAGS  = $(if $(WITH_MPI),-DMGPU_MPI=1 $(shell mpicc --showme:compile))
MPI_LIBS   = $(if $(WITH_MPI),$(shell mpicc --showme:link))
# The CPU kernels' vector instructions: AVX2 and FMA where this machine
# has them (the programs run where they are built). -ffp-contract=off: a *
# b + c stays two roundings, as the code says, FMA or not; fmaf becomes
# one instruction instead of a call.
CPU_ARCH   := $(if $(shell grep -qw avx2 /proc/cpuinfo 2>/dev/null && grep -qw fma /proc/cpuinfo && echo y),-mavx2 -mfma -ffp-contract=off)
CFLAGS_C   = -std=c11 -Wall -Wextra -Werror -D_GNU_SOURCE -O3 -g $(OPENMP) $(ONEDNN) $(MPI_FLAGS) $(CPU_ARCH)
LIBS       = $(if $(BLAS_DIR),-L$(BLAS_DIR) -Wl$(COMMA)-rpath$(COMMA)$(BLAS_DIR)) $(ONEDNN_LIB) $(MPI_LIBS) -lopenblas -lstb -lz -lpthread -lm
COMMA      := ,
SPACE      := $(subst ,, )
ASAN       := -O1 -g -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined

# ------------------------------------------------------------ is nvcc there?
ifeq ($(USE_CUDA),0)
HAVE_NVCC := 0
else
# (the answer is kept in build/, one file for each nvcc asked: the probe
# takes seconds, and make runs again for each assignment checked; make clean
# forgets it)
NVCC_PROBED := $(BUILD)/have-nvcc$(subst /,-,$(NVCC))
HAVE_NVCC := $(shell cat $(NVCC_PROBED) 2>/dev/null || { mkdir -p $(BUILD) && printf '__global__ void k(){}\nint main(){k<<<1,1>>>();return 0;}\n' > $(BUILD)/probe.cu && $(NVCC) -o $(BUILD)/probe $(BUILD)/probe.cu >/dev/null 2>&1 && echo 1 || echo 0; } | tee $(NVCC_PROBED))
endif
# Machine code for each of CUDA_ARCHS, compute capability 9.0's for
# sm_90a (Hopper's own instructions: kernels/conv_nhwc.h's wgmma), and
# PTX of the last for newer GPUs to compile at start.
SASS_ARCH   = $(if $(filter 90,$(1)),90a,$(1))
GENCODE    := $(foreach a,$(CUDA_ARCHS),-gencode=arch=compute_$(call SASS_ARCH,$(a)),code=sm_$(call SASS_ARCH,$(a))) \
              -gencode=arch=compute_$(lastword $(CUDA_ARCHS)),code=compute_$(lastword $(CUDA_ARCHS))
NVFLAGS     = -x cu -std=c++17 -O3 -g $(GENCODE) -Xcompiler -Wall,-Wextra$(if $(OPENMP),$(COMMA)$(OPENMP))$(subst $(SPACE),,$(foreach f,$(CPU_ARCH),$(COMMA)$(f))) -D_GNU_SOURCE $(ONEDNN) \
              $(CUDNN) $(MPI_FLAGS) -I$(NCCL_HOME)/include
LAST_ARCH  := $(lastword $(CUDA_ARCHS))
NVFLAGS_CHECK = -x cu -std=c++17 -O0 \
              -gencode=arch=compute_$(call SASS_ARCH,$(LAST_ARCH)),code=sm_$(call SASS_ARCH,$(LAST_ARCH)) \
              -Xcompiler -Wall,-Wextra$(if $(OPENMP),$(COMMA)$(OPENMP)) -D_GNU_SOURCE $(ONEDNN) $(CUDNN) $(MPI_FLAGS) -I$(NCCL_HOME)/include
# pip's NCCL ships libnccl.so.2 without the libnccl.so link -lnccl looks for
NCCL_LIB   := $(if $(wildcard $(NCCL_HOME)/lib/libnccl.so $(NCCL_HOME)/lib64/libnccl.so),-lnccl,-l:libnccl.so.2)
CUDA_LIBS   = -L$(CUDA_HOME)/lib64 -L$(NCCL_HOME)/lib -L$(NCCL_HOME)/lib64 \
              -Xlinker -rpath,$(CUDA_HOME)/lib64 -Xlinker -rpath,$(NCCL_HOME)/lib \
              $(if $(BLAS_DIR),-L$(BLAS_DIR) -Xlinker -rpath$(COMMA)$(BLAS_DIR)) \
              -lcublas $(CUDNN_LIB) $(NCCL_LIB) -lcudart $(if $(OPENMP),-lgomp) $(ONEDNN_LIB) $(MPI_LIBS) -lopenblas -lstb -lz -lpthread -lm

ifeq ($(HAVE_NVCC),1)
COMPILE    = $(NVCC) $(NVFLAGS) -I. $< -o $@ $(CUDA_LIBS)
else
COMPILE    = $(CC) $(CFLAGS_C) -I. $< -o $@ $(LIBS)
endif

HEADERS    := mgpu.h $(wildcard kernels/*.h) $(wildcard mgpu/*.h)
CHAPTERS   := $(sort $(wildcard chapters/[0-9][0-9]_*.c))
CPU_TESTS  := $(sort $(wildcard tests/test_*.c))
GPU_TESTS  := $(sort $(wildcard tests/gpu_*.c))
# (a GPU test includes a CPU test, or the distributed tests, whole)
INCLUDED_SOURCES := $(CPU_TESTS) tests/dist_tests.c

# chapters/01_automatic_parallelism.c -> chapter1
chapter_number = $(shell echo $(notdir $(1)) | sed 's/^0*\([0-9]*\)_.*/\1/')
CHAPTER_BINS := $(foreach c,$(CHAPTERS),chapter$(call chapter_number,$(c)))

.PHONY: all deps test test-long test-gpu test-asan bench data clean check-assignment FORCE

all: $(CHAPTER_BINS)

# ------------------------------------------------------- Debian packages
# Each library is looked for by compiling and linking a tiny program, so
# a copy outside /usr found through CPATH and LIBRARY_PATH counts (as on
# the GPU machine, which has no package registry: bench/gpu_session.sh).
# Missing ones are installed with apt-get when running as root; otherwise
# the command is printed. The optional ones (OpenBLAS for OpenMP, oneDNN
# and Open MPI, above) are installed when running as root, and skipped
# when they cannot be.
DEPS_STAMP := $(BUILD)/deps.ok
deps: $(DEPS_STAMP)
$(DEPS_STAMP):
	@mkdir -p $(BUILD)
	@missing=""; \
	  for dep in "cblas.h openblas libopenblas-dev" "stb/stb_image_write.h stb libstb-dev" \
	             "zlib.h z zlib1g-dev"; do \
	    set -- $$dep; \
	    printf '#include <%s>\nint main(void) { return 0; }\n' $$1 | \
	      $(CC) -x c - -o $(BUILD)/deps-probe -l$$2 >/dev/null 2>&1 || missing="$$missing $$3"; \
	  done; \
	  if [ -n "$$missing" ]; then \
	    if [ "$$(id -u)" = 0 ]; then \
	      echo "installing:$$missing"; \
	      (apt-get install -y $$missing || (apt-get update && apt-get install -y $$missing)) >/dev/null || exit 1; \
	    else \
	      echo "mgpu needs:$$missing. Install them with:"; \
	      echo "  sudo apt-get install -y$$missing"; exit 1; \
	    fi; \
	  fi
	@if [ ! -e $(OPENBLAS_OPENMP)/libopenblas.so ] && [ "$$(id -u)" = 0 ] && [ "$(USE_OPENMP)" != 0 ]; then \
	    echo "installing: libopenblas-openmp-dev (optional: the CPU kernels on all their cores)"; \
	    apt-get install -y libopenblas-openmp-dev >/dev/null 2>&1 || \
	      echo "  not installed: a CPU device's own kernels run on one thread"; \
	  fi
	@if [ ! -e /usr/include/oneapi/dnnl/dnnl.h ] && [ "$$(id -u)" = 0 ] && [ "$(USE_ONEDNN)" != 0 ]; then \
	    echo "installing: libdnnl-dev (optional: oneDNN's convolutions on CPU devices)"; \
	    apt-get install -y libdnnl-dev >/dev/null 2>&1 || echo "  not installed: the CPU convolutions take im2col"; \
	  fi
	@if ! mpicc --showme:compile >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] && [ "$(USE_MPI)" != 0 ]; then \
	    echo "installing: openmpi-bin libopenmpi-dev (optional: chapter 4's processes)"; \
	    apt-get install -y openmpi-bin libopenmpi-dev >/dev/null 2>&1 || \
	      echo "  not installed: every program is a group of one process"; \
	  fi
	@touch $@

# --------------------------------------------------------------- chapters
# Chapters 2 and 3 train on Fashion-MNIST: building them also fills
# data/fashion-mnist (make data), so `make chapter3 && ./chapter3` is all a
# fresh machine needs.
DATA_FILE := data/fashion-mnist/t10k-labels-idx1-ubyte.gz
$(DATA_FILE):
	@bash data/fetch.sh
needs_data = $(if $(filter 1,$(call chapter_number,$(1))),,$(DATA_FILE))

define chapter_rule
chapter$(call chapter_number,$(1)): $(1) $$(HEADERS) $$(DEPS_STAMP) $(call needs_data,$(1))
	$$(COMPILE)
endef
$(foreach c,$(CHAPTERS),$(eval $(call chapter_rule,$(c))))

# make test runs the chapters' CPU builds: where nvcc builds ./chapterN,
# gcc builds them again in build/cpu (nvcc's take a minute each; make
# test-long runs those).
define cpu_chapter_rule
$(BUILD)/cpu/chapter$(call chapter_number,$(1)): $(1) $$(HEADERS) $$(DEPS_STAMP) $(call needs_data,$(1))
	@mkdir -p $$(dir $$@)
	$$(CC) $$(CFLAGS_C) -I. $$< -o $$@ $$(LIBS)
endef
$(foreach c,$(CHAPTERS),$(eval $(call cpu_chapter_rule,$(c))))

# ----------------------------------------------------------------- tests
$(BUILD)/tests/%: tests/%.c $(wildcard tests/*.h) $(HEADERS) $(DEPS_STAMP)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_C) -O1 -I. $< -o $@ $(LIBS)

$(BUILD)/asan/%: tests/%.c $(wildcard tests/*.h) $(HEADERS) $(DEPS_STAMP)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_C) $(ASAN) -I. $< -o $@ $(LIBS)

$(BUILD)/cuda/%: tests/%.c $(wildcard tests/*.h) $(INCLUDED_SOURCES) $(HEADERS) $(DEPS_STAMP)
	@mkdir -p $(dir $@)
	$(NVCC) $(NVFLAGS) -I. $< -o $@ $(CUDA_LIBS)

# `make test` checks that every test's CUDA build compiles and links (it
# cannot run their GPU half without a GPU): for the last of CUDA_ARCHS
# alone, host code unoptimised, 2.5 times faster than the full build; in
# a folder of their own, so that test-gpu builds and runs the full ones.
$(BUILD)/cuda-check/%: tests/%.c $(wildcard tests/*.h) $(INCLUDED_SOURCES) $(HEADERS) $(DEPS_STAMP)
	@mkdir -p $(dir $@)
	$(NVCC) $(NVFLAGS_CHECK) -I. $< -o $@ $(CUDA_LIBS)

# tests/test_chapter5.c includes chapter 5 whole, to test its own decisions.
$(BUILD)/tests/test_chapter5 $(BUILD)/asan/test_chapter5 $(BUILD)/cuda-check/test_chapter5: chapters/05_memory.c

CPU_TEST_BINS  := $(patsubst tests/%.c,$(BUILD)/tests/%,$(CPU_TESTS))

# The distributed tests run under mpirun (tests/dist.sh), and once built
# without MPI, to see that mpirun starting such a program is an error.
DIST_TEST_BINS := $(BUILD)/tests/dist_tests $(BUILD)/nompi/dist_tests
$(BUILD)/nompi/%: tests/%.c $(wildcard tests/*.h) $(HEADERS) $(DEPS_STAMP)
	@mkdir -p $(dir $@)
	$(CC) $(subst -DMGPU_MPI=1,-DMGPU_MPI=0,$(CFLAGS_C)) -O1 -I. $< -o $@ $(LIBS)

# The layers' tests once more as a program built by hand would be: no
# OpenMP, no oneDNN, the default OpenBLAS (the convolutions by im2col).
PLAIN_TEST_BINS := $(BUILD)/plain/test_layers
$(BUILD)/plain/%: tests/%.c $(wildcard tests/*.h) $(HEADERS) $(DEPS_STAMP)
	@mkdir -p $(dir $@)
	$(CC) -std=c11 -Wall -Wextra -Werror -D_GNU_SOURCE -O1 -g -I. $< -o $@ -lopenblas -lstb -lz -lpthread -lm

# The CUDA kernels run on the CPU (tests/cuda_emu.h): their launches
# kernel<<<config>>>(args); (kernel may be a template's, name<V>) are
# rewritten into calls of the emulator, and
# the kernels are compared with their CPU references, GPU or not.
# Each kernel file rewritten for the emulator, in build/emu/kernels/
# (a kernel file's #include of another finds the rewritten one there),
# and build/emu/kernels.h includes them in the order mgpu.h does.
EMU_TEST     := $(BUILD)/tests/emu_kernels
KERNEL_FILES := $(shell sed -n 's/^\#include "\(kernels\/[a-z_]*\.h\)"/\1/p' mgpu.h)
EMU_KERNELS  := $(patsubst kernels/%,$(BUILD)/emu/kernels/%,$(wildcard kernels/*.h))
$(BUILD)/emu/kernels/%.h: kernels/%.h
	@mkdir -p $(dir $@)
	perl -0pe 's/(\w+(?:<[\w, ]*>)?)<<<(.*?)>>>\((.*?)\);/mgpu_emu_launcher($$2)($$1, $$3);/gs' $< > $@
$(BUILD)/emu/kernels.h: $(EMU_KERNELS) Makefile
	@printf '#include "%s"\n' $(KERNEL_FILES) > $@
$(EMU_TEST): tests/emu_kernels.cpp tests/cuda_emu.h tests/cuda_emu_runtime.h tests/test.h $(BUILD)/emu/kernels.h $(DEPS_STAMP)
	@mkdir -p $(dir $@)
	$(CXX) -std=c++20 -O1 -Wall -Wextra -Werror -Itests -I$(BUILD)/emu $< -o $@ -lopenblas -lpthread

# The GPU tests (tests/gpu_*.c) on emulated GPUs: the library's whole CUDA
# path, built with g++ against tests/cuda_emu.h (MGPU_CUDA_EMU: kernels on
# the CPU; the CUDA runtime, cuBLAS, cuDNN and NCCL emulated; 2 GPUs). Tests too
# slow there are marked TEST_REAL_GPU and run on real GPUs only.
# cuDNN is emulated too; the whole models' tests run once more without it,
# as a GPU build where cuDNN is not found would.
EMU_GPU_BINS := $(patsubst tests/%.c,$(BUILD)/emu/%,$(GPU_TESTS)) $(BUILD)/emu-no-cudnn/gpu_fixtures
EMU_BUILD     = $(CXX) -x c++ -std=c++20 -O1 -Wall -Wextra -Werror -D_GNU_SOURCE $(OPENMP) $(MPI_FLAGS) -include tests/cuda_emu.h \
	  -Itests -I$(BUILD)/emu -I. $< -o $@ $(LIBS)
$(BUILD)/emu/gpu_%: tests/gpu_%.c $(wildcard tests/*.h) $(INCLUDED_SOURCES) $(HEADERS) $(BUILD)/emu/kernels.h $(DEPS_STAMP)
	@mkdir -p $(dir $@)
	$(EMU_BUILD) -DMGPU_CUDNN=1
$(BUILD)/emu-no-cudnn/gpu_%: tests/gpu_%.c $(wildcard tests/*.h) $(INCLUDED_SOURCES) $(HEADERS) $(BUILD)/emu/kernels.h $(DEPS_STAMP)
	@mkdir -p $(dir $@)
	$(EMU_BUILD)
# (the distributed tests as a group of one: tests/dist.sh runs them under mpirun)
ASAN_TEST_BINS := $(patsubst tests/%.c,$(BUILD)/asan/%,$(CPU_TESTS)) $(BUILD)/asan/dist_tests
CUDA_TEST_BINS := $(patsubst tests/%.c,$(BUILD)/cuda/%,$(CPU_TESTS) $(GPU_TESTS))

BENCH_BINS := bench/matmul bench/overlap bench/allreduce bench/profile bench/convolutions bench/ddp bench/checkpoint \
              bench/zero bench/pipeline
# The benchmarks are built too (they run on the GPU machine only, and a
# change of an internal signature must not break them unseen there): with
# nvcc as checked builds, beside the tests'.
# (A CPU test that a GPU test includes whole, test_comm.c in gpu_comm.c,
# is compiled by nvcc there already.)
INCLUDED_TESTS := $(addprefix tests/,$(shell sed -n 's/^\#include "\(test_[a-z_]*\.c\)"/\1/p' $(GPU_TESTS)))
ifeq ($(HAVE_NVCC),1)
TEST_BUILDS := $(patsubst tests/%.c,$(BUILD)/cuda-check/%,$(filter-out $(INCLUDED_TESTS),$(CPU_TESTS)) $(GPU_TESTS)) \
               $(patsubst bench/%,$(BUILD)/cuda-check/bench_%,$(BENCH_BINS))
else
TEST_BUILDS := $(BENCH_BINS)
endif
$(BUILD)/cuda-check/bench_%: bench/%.c $(HEADERS) $(DEPS_STAMP)
	@mkdir -p $(dir $@)
	$(NVCC) $(NVFLAGS_CHECK) -I. $< -o $@ $(CUDA_LIBS)

# The tests run as many at a time as there are cores (TEST_JOBS), the
# longest first, so that none ends on one long job alone; each test's
# output is shown whole, in this order. test-gpu runs them one at a time,
# so that each has the GPU to itself.
#
# make test fits in 10 minutes on 2 cores, build included: gcc's builds
# alone (the chapters' CPU builds, in build/cpu where nvcc builds the
# checkout's), and each program's tests but those marked TEST_LONG
# (TEST_SET=quick). make test-long runs the rest: nvcc's builds (the
# chapters, and every test's and benchmark's checked CUDA build), the
# TEST_LONG tests, the smoke runs again on nvcc's chapters, and the GPU
# check's rehearsal (tests/gpu_check_rehearsal.sh: it runs the benchmark
# programs built here, the checked CUDA builds or the CPU ones). CI runs
# both.
TEST_JOBS ?= $(NPROC)
REHEARSE_BENCH := $(if $(filter 1,$(HAVE_NVCC)),$(BUILD)/cuda-check/bench_,bench/)
TEST_CHAPTER_DIR := $(if $(filter 1,$(HAVE_NVCC)),$(BUILD)/cpu,.)
TEST_PROGRAMS := $(EMU_TEST) $(EMU_GPU_BINS) $(CPU_TEST_BINS) $(PLAIN_TEST_BINS)
test: $(addprefix $(TEST_CHAPTER_DIR)/,$(CHAPTER_BINS)) $(TEST_PROGRAMS) $(DIST_TEST_BINS)
	@TEST_SET=quick TEST_JOBS=$(TEST_JOBS) CHAPTER_DIR=$(TEST_CHAPTER_DIR) PARTS_CFLAGS='$(OPENMP) $(ONEDNN) $(MPI_FLAGS)' \
	  bash tests/run.sh tests/dist.sh tests/smoke.sh tests/repeat.sh tests/assignments.sh $(TEST_PROGRAMS) \
	  tests/kernels_alone.sh tests/parts_alone.sh tests/settings_listed.sh tests/internals_listed.sh

# (TEST_LONG marks a test long only on emulated GPUs: the emulated
# programs alone have any)
test-long: all $(TEST_BUILDS) $(EMU_TEST) $(EMU_GPU_BINS)
	@TEST_SET=long TEST_JOBS=$(TEST_JOBS) REHEARSE_BENCH=$(REHEARSE_BENCH) bash tests/run.sh tests/gpu_check_rehearsal.sh \
	  $(if $(filter 1,$(HAVE_NVCC)),tests/smoke.sh) $(EMU_TEST) $(EMU_GPU_BINS)

# A student's solution of an assignment (docs/assignments.md), built with
# its checker and run: make check-assignment NAME=ring FILE=student.c
# (NAME: ring, layer, measure, sampler, checkpoint, pipeline, zero3 or
# zero_bubble). The checker prints a pass or a fail per test; the exit
# status says whether all passed. The library is compiled once, into
# $(BUILD)/assignments/mgpu.o (mgpu.h with MGPU_IMPLEMENTATION), and each
# check compiles only the checker with the student's file and links it,
# as a course's programs link a library; the object is made again when
# the headers or the compile command change (mgpu.flags keeps the last
# one). (Warnings, not errors, on both: an unused parameter of a
# student's, or a warning of a compiler newer than ours, is no failure.)
ASSIGNMENTS := $(patsubst tests/assignments/check_%.c,%,$(wildcard tests/assignments/check_*.c))
ASSIGNMENT_CC := $(CC) $(filter-out -Werror,$(CFLAGS_C))
$(BUILD)/assignments/mgpu.flags: FORCE
	@mkdir -p $(@D)
	@echo '$(ASSIGNMENT_CC)' | cmp -s - $@ || echo '$(ASSIGNMENT_CC)' > $@
$(BUILD)/assignments/mgpu.o: $(HEADERS) $(DEPS_STAMP) $(BUILD)/assignments/mgpu.flags
	$(ASSIGNMENT_CC) -DMGPU_IMPLEMENTATION -x c -c mgpu.h -o $@
check-assignment:
	@if [ -z "$(filter $(ASSIGNMENTS),$(NAME))" ] || [ ! -f "$(FILE)" ]; then \
	  echo "usage: make check-assignment NAME=<$(subst $(SPACE),|,$(ASSIGNMENTS))> FILE=<your .c file>" >&2; exit 2; fi
	@$(MAKE) -s --no-print-directory $(BUILD)/assignments/mgpu.o
	@$(ASSIGNMENT_CC) -O1 -I. -DSTUDENT_FILE='"$(abspath $(FILE))"' tests/assignments/check_$(NAME).c \
	  $(BUILD)/assignments/mgpu.o -o $(BUILD)/assignments/check_$(NAME) $(LIBS)
	@$(BUILD)/assignments/check_$(NAME)
FORCE:

# (allocator_may_return_null: an allocation past what ASan allows returns
# NULL, as glibc's malloc does, so the library's out-of-memory line is what
# its test meets, not ASan's abort)
test-asan: $(ASAN_TEST_BINS)
	@ASAN_OPTIONS=detect_leaks=1:allocator_may_return_null=1 bash tests/run.sh $(ASAN_TEST_BINS)

test-gpu: $(CUDA_TEST_BINS) all
	@bash tests/run.sh $(CUDA_TEST_BINS) tests/smoke.sh

# ------------------------------------------------------------- benchmarks
# The convolution variants that lost on every pass of the GPU profile
# (bench/conv/, numbered): each a standalone CUDA program with its own
# kernels, its CPU check and its timing. Built by make bench, not by make
# test; a variant returns to kernels/ when a GPU measurement shows it
# winning a pass of ResNet-18's step by 3% or more (bench/RESULTS.md).
CONV_VARIANTS := $(patsubst %.cu,%,$(wildcard bench/conv/[0-9][0-9]_*.cu))
bench/conv/%: bench/conv/%.cu
	$(NVCC) -O3 -std=c++17 $(GENCODE) -Xcompiler -Wall,-Wextra $< -o $@

bench: all $(BENCH_BINS) $(if $(filter 1,$(HAVE_NVCC)),$(CONV_VARIANTS))
	@bash bench/run.sh

# The allreduce benchmark: the book's allreduce, the ring and NCCL.
bench/allreduce: bench/allreduce.c $(HEADERS) $(DEPS_STAMP)
	$(COMPILE)

# mgpu_matmul against cuBLAS (or cblas) called directly.
bench/matmul: bench/matmul.c $(HEADERS) $(DEPS_STAMP)
	$(COMPILE)

# A ResNet-18 step on 2 devices: no gradient reduction, after backward, overlapped.
bench/overlap: bench/overlap.c $(HEADERS) $(DEPS_STAMP)
	$(COMPILE)

# A step of the distributed wrapper on 1 and 2 processes (under mpirun),
# and of chapter 3's wrapper on 2 devices of one process.
bench/ddp: bench/ddp.c $(HEADERS) $(DEPS_STAMP)
	$(COMPILE)

# A ResNet-18 step with and without gradient checkpointing.
bench/checkpoint: bench/checkpoint.c $(HEADERS) $(DEPS_STAMP)
	$(COMPILE)

# ResNet-18 steps on 2 devices under DDP, ZeRO-1 and ZeRO-2.
bench/zero: bench/zero.c $(HEADERS) $(DEPS_STAMP)
	$(COMPILE)

# An MLP's steps in 2 (or 4) stages: naive, GPipe and 1F1B.
bench/pipeline: bench/pipeline.c $(HEADERS) $(DEPS_STAMP)
	$(COMPILE)

# Where the time of a ResNet-18 step goes (the tracer's summary).
bench/profile: bench/profile.c $(HEADERS) $(DEPS_STAMP)
	$(COMPILE)

# What NCCL does between processes, two on one GPU too (under mpirun; CUDA only).
bench/nccl_ranks: bench/nccl_ranks.c $(DEPS_STAMP)
	$(NVCC) $(NVFLAGS) $< -o $@ $(CUDA_LIBS)

# ResNet-18's convolutions one by one: im2col against each fast kernel and tile.
bench/convolutions: bench/convolutions.c $(HEADERS) $(DEPS_STAMP)
	$(COMPILE)

# ------------------------------------------------------------------ data
data:
	@bash data/fetch.sh

clean:
	rm -rf $(BUILD) chapter[0-9]

# make print-VAR: what the Makefile found, e.g. make print-CUDNN_HOME
print-%:
	@echo '$*=$($*)'

