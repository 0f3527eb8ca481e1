// A CUPTI injection library that records every kernel's start and end
// (GPU timestamps, ns) and name, one line `K start end name` each, to
// $KERNEL_TRACE_OUT (default /tmp/kernels.txt), written at exit. The CUDA
// driver loads it into any process (Bastile's binaries load CUDA at run
// time, so nothing is linked) when CUDA_INJECTION64_PATH names it.
// `gpu_busy.py` then says how much of the last steps' wall time the GPU
// was busy: with the step time, whether the host or the device bounds it.
//
// Build on the GPU machine (KTYPE: the newest CUpti_ActivityKernelN the
// CUPTI headers define; CUDA 13 has CUpti_ActivityKernel10):
//   inc=$(dirname $(find /usr/local -name cupti_activity.h | head -1))
//   lib=$(dirname $(find /usr/local -name 'libcupti.so*' | head -1))
//   gcc -O2 -shared -fPIC -DKTYPE=CUpti_ActivityKernel10 -I$inc \
//       kernel_trace.c -L$lib -lcupti -Wl,-rpath,$lib -o /tmp/libkernel_trace.so
// Run:
//   CUDA_INJECTION64_PATH=/tmp/libkernel_trace.so ./bastile-bench --runtime cuda \
//       --model qwen3-0.6b --seq 2048 --batch 1 --impl bastile --child
//   python3 gpu_busy.py /tmp/kernels.txt 600
#include <cupti.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define BUF_SIZE (8 * 1024 * 1024)
static FILE *out;
// KERNEL_TRACE_PLACE set: each name starts with `[d<device> s<stream>] `,
// for runs on several GPUs or streams (`step_gaps.py`, `streams_overlap.py`).
static int with_place;
// KERNEL_TRACE_API set: every CUDA driver call too, one line `A start end
// thread name` each (host timestamps on the kernels' clock), to see what the
// host did while the GPU waited (`host_gaps.py`).
static int with_api;

static void CUPTIAPI buffer_requested(uint8_t **buffer, size_t *size, size_t *max_records) {
  *buffer = (uint8_t *)aligned_alloc(8, BUF_SIZE);
  *size = BUF_SIZE;
  *max_records = 0;
}

static void CUPTIAPI buffer_completed(CUcontext ctx, uint32_t stream, uint8_t *buffer, size_t size, size_t valid) {
  CUpti_Activity *record = NULL;
  while (cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS) {
    if (record->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL || record->kind == CUPTI_ACTIVITY_KIND_KERNEL) {
      KTYPE *k = (KTYPE *)record;
      if (!out) continue;
      if (with_place)
        fprintf(out, "K %llu %llu [d%u s%u] %s\n", (unsigned long long)k->start, (unsigned long long)k->end,
                k->deviceId, k->streamId, k->name ? k->name : "?");
      else
        fprintf(out, "K %llu %llu %s\n", (unsigned long long)k->start, (unsigned long long)k->end, k->name ? k->name : "?");
    } else if (record->kind == CUPTI_ACTIVITY_KIND_DRIVER && out) {
      CUpti_ActivityAPI *a = (CUpti_ActivityAPI *)record;
      const char *name = NULL;
      if (cuptiGetCallbackName(CUPTI_CB_DOMAIN_DRIVER_API, a->cbid, &name) != CUPTI_SUCCESS || !name) name = "?";
      fprintf(out, "A %llu %llu %u %s\n", (unsigned long long)a->start, (unsigned long long)a->end, a->threadId, name);
    }
  }
  free(buffer);
}

static void at_exit(void) {
  cuptiActivityFlushAll(1);
  if (out) fclose(out);
}

int InitializeInjection(void) {
  const char *path = getenv("KERNEL_TRACE_OUT");
  out = fopen(path ? path : "/tmp/kernels.txt", "w");
  with_place = getenv("KERNEL_TRACE_PLACE") != NULL;
  with_api = getenv("KERNEL_TRACE_API") != NULL;
  cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed);
  cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
  if (with_api) cuptiActivityEnable(CUPTI_ACTIVITY_KIND_DRIVER);
  atexit(at_exit);
  return 1;
}
