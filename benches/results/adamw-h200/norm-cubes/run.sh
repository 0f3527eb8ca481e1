#!/usr/bin/env bash
# One op benchmark with and without a kernel trace: OPS (e.g. "adamw"), BUILD.
set -u
R=$OUT/r; mkdir -p $R
w=/tmp/w; mkdir -p $w
b=${BUILD:-bench-n}
[ -x $w/$b ] || { xz -dc .device/b/$b.xz > $w/$b && chmod +x $w/$b; }
inc=$(dirname $(find /usr/local -name cupti_activity.h | head -1))
lib=$(dirname $(find /usr/local -name 'libcupti.so*' | head -1))
[ -f /tmp/libkt.so ] || gcc -O2 -shared -fPIC -DKTYPE=CUpti_ActivityKernel10 -I$inc benches/cupti/kernel_trace.c -L$lib -lcupti -Wl,-rpath,$lib -o /tmp/libkt.so
d=/tmp/caches-$b; mkdir -p $d
for op in ${OPS:-adamw}; do
  for mode in plain trace; do
    inj=""; [ $mode = trace ] && inj=/tmp/libkt.so
    ( cd $d && env KERNEL_TRACE_OUT=$R/k-$op.txt CUDA_INJECTION64_PATH=$inj KERNEL_TRACE_API=1 \
      BASTILE_KERNEL_CACHE=$d/kernels CUDA_CACHE_PATH=$d/cuda XDG_CACHE_HOME=$d/xdg timeout 200 $w/$b --runtime cuda \
      --op $op ${ARGS:-} --out $R/$op-$mode.json > $R/$op-$mode.log 2>&1 ); echo "rc $?" >> $R/$op-$mode.log
    echo "== $op $mode"; grep -E "^\| $op|error|panick" $R/$op-$mode.log | head -6
  done
  [ -f $R/k-$op.txt ] && xz -T4 $R/k-$op.txt
done
tar -C $OUT -cJf $OUT/r-${TAG:-op}.tar.xz r && rm -rf $R
