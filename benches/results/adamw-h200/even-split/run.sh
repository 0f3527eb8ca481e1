#!/usr/bin/env bash
# The fused AdamW step's kernels in one lease: the kernel crate's AdamW
# tests on CUDA (X/tcu.xz, when carried), then `bastile-bench --op adamw`
# of each build in BUILDS (X/<build>.xz), alternating for each of ROUNDS,
# plainly and under the kernel trace, and `step_busy.py` over each trace.
# env: X (the carried folder, .device/x2), BUILDS, ROUNDS, TEST_FILTER.
set -u
R=$OUT/r; mkdir -p $R
w=/tmp/w; mkdir -p $w
X=${X:-.device/x2}
here=benches/results/adamw-h200
t0=$(date +%s)
if [ -f $X/tcu.xz ]; then
  [ -x $w/tcu ] || { xz -dc $X/tcu.xz > $w/tcu && chmod +x $w/tcu; }
  ( cd bastile-cubecl && BASTILE_TEST_RUNTIMES=cuda timeout ${WAIT:-300} $w/tcu --test-threads ${THREADS:-4} ${TEST_FILTER:-adamw} > $R/cuda-tests.log 2>&1; echo "rc $?" >> $R/cuda-tests.log )
  grep -E "^test |test result|panicked|rc " $R/cuda-tests.log
  echo "== tests took $(( $(date +%s) - t0 )) s"
fi
inc=$(dirname $(find /usr/local -name cupti_activity.h | head -1))
lib=$(dirname $(find /usr/local -name 'libcupti.so*' | head -1))
[ -f /tmp/libkt.so ] || gcc -O2 -shared -fPIC -DKTYPE=CUpti_ActivityKernel10 -I$inc benches/cupti/kernel_trace.c -L$lib -lcupti -Wl,-rpath,$lib -o /tmp/libkt.so
for round in ${ROUNDS:-1 2}; do
  for b in $BUILDS; do
    [ -x $w/$b ] || { xz -dc $X/$b.xz > $w/$b && chmod +x $w/$b; }
    d=/tmp/caches-$b; mkdir -p $d
    o=$R/$b-$round; mkdir -p $o
    for mode in plain trace; do
      inj=""; [ $mode = trace ] && inj=/tmp/libkt.so
      ( cd $d && env KERNEL_TRACE_OUT=$o/k-adamw.txt CUDA_INJECTION64_PATH=$inj KERNEL_TRACE_API=1 \
        BASTILE_KERNEL_CACHE=$d/kernels CUDA_CACHE_PATH=$d/cuda XDG_CACHE_HOME=$d/xdg timeout 200 $w/$b --runtime cuda \
        --op adamw --out $o/adamw-$mode.json > $o/adamw-$mode.log 2>&1 ); echo "rc $?" >> $o/adamw-$mode.log
      echo "== $b $round $mode at $(( $(date +%s) - t0 )) s"; grep -E "^\| adamw|error|panick" $o/adamw-$mode.log | head -4
    done
    xz -T4 $o/k-adamw.txt && python3 $here/norm-cubes/step_busy.py $o/k-adamw.txt.xz | tee -a $R/step-busy.txt
  done
done
# The traces stay on the machine: they are larger than what comes back.
tar -C $OUT -cJf $OUT/r-${TAG:-adamw}.tar.xz --exclude='k-*' r && rm -rf $R
