#!/usr/bin/env bash
# A/B lease: RUNS of "build:model:seq:steps" (training), "build:op:NAME" (--op), "torch:model:seq" (HF, HF + Liger),
# "perf:build:model:seq" (flat host profile with the carried perf); "set:SWEEP_ARGS:--flag=value" adds
# a flag to the sweeps after it.
set -u
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt
w=/tmp/w; mkdir -p $w
for b in ${BUILDS:-bench-a bench-o}; do [ -x $w/$b ] || { xz -dc .device/b/$b.xz > $w/$b && chmod +x $w/$b; }; done
[ -d /tmp/site ] || { ls .whl/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl; }
[ -f .device/perfb.tar.xz ] && [ ! -d /tmp/perfb ] && tar -C /tmp -xJf .device/perfb.tar.xz
inc=$(dirname $(find /usr/local -name cupti_activity.h | head -1))
lib=$(dirname $(find /usr/local -name 'libcupti.so*' | head -1))
[ -f /tmp/libkt.so ] || gcc -O2 -shared -fPIC -DKTYPE=CUpti_ActivityKernel10 -I$inc benches/cupti/kernel_trace.c -L$lib -lcupti -Wl,-rpath,$lib -o /tmp/libkt.so
P="/tmp/perfb/lib/ld-linux-x86-64.so.2 --library-path /tmp/perfb/lib /tmp/perfb/perf"
bench() { # build tag prefix-cmd... -- args
  local b=$1 tag=$2; shift 2
  local d=/tmp/caches-$b; mkdir -p $d
  ( cd $d && BASTILE_KERNEL_CACHE=$d/kernels CUDA_CACHE_PATH=$d/cuda XDG_CACHE_HOME=$d/xdg timeout ${BENCH_TIMEOUT:-240} "$@" ) > $R/$tag.log 2>&1
  echo "rc $?" >> $R/$tag.log
  echo "== $tag"; grep -E "ms/step|error|panick|^\| moe|host ms" $R/$tag.log | grep -v '^| model' | head -4
}
i=0
for run in $RUNS; do
  i=$((i+1)); IFS=: read a b c d <<< "$run"; d0=$d
  case $a in
    torch) PYTHONPATH=/tmp/site timeout ${TORCH_TIMEOUT:-300} python3 benches/python/train_torch.py --model $b --seq $c --batch ${d:-1} \
        --impl ${TORCH_IMPLS:-hf liger} --steps ${TSTEPS:-10} --out $R/$i-torch-$b-$c-${d:-1}.jsonl > $R/$i-torch-$b-$c.log 2>&1; echo "rc $?" >> $R/$i-torch-$b-$c.log
      python3 -c "
import json
for l in open('$R/$i-torch-$b-$c-${d:-1}.jsonl'):
    r = json.loads(l); print('torch $b $c b${d:-1}', r['implementation'], 'ms', round(r.get('ms_per_step') or 0, 1), 'in use', round(r.get('in_use_mib') or 0), r.get('error'))" 2>&1 | tail -3 ;;
    ktrace) bench $b $i-kt-$b-$c-$d env KERNEL_TRACE_OUT=$R/k-$i.txt CUDA_INJECTION64_PATH=/tmp/libkt.so $w/$b --runtime ${RT:-cuda} --model $c --seq $d --batch 1 --impl bastile --steps 12 --no-cold-start --out $R/$i-kt.json
      python3 benches/results/moe-routed-h100/device-router/step_kernels.py $R/k-$i.txt > $R/$i-step-kernels.txt 2>&1; sed -n 1,45p $R/$i-step-kernels.txt | grep -A40 "steps found"; xz -T4 $R/k-$i.txt ;;
    tests) mkdir -p /tmp/tt; for t in ${b//,/ }; do xz -dc .device/b/tests-$t.xz > /tmp/tt/$t && chmod +x /tmp/tt/$t
        ( cd /tmp && BASTILE_TEST_RUNTIMES=cuda timeout ${WAIT:-300} /tmp/tt/$t --test-threads ${TT:-2} ${c//,/ } > $R/tests-$t.log 2>&1; echo "rc $?" >> $R/tests-$t.log )
        grep -E "test result|panicked|FAILED|rc " $R/tests-$t.log | tail -8; done ;;
    tune) d=/tmp/caches-tune-$c-$d; mkdir -p $d; printf '[autotune.logger]\nlevel = "full"\nstderr = true\n' > $d/cubecl.toml
      ( cd $d && BASTILE_TUNE=full BASTILE_KERNEL_CACHE=$d/kernels CUDA_CACHE_PATH=$d/cuda XDG_CACHE_HOME=$d/xdg timeout ${BENCH_TIMEOUT:-240} $w/$b --runtime ${RT:-cuda} --model $c --seq $d0 --batch 1 --impl bastile --steps 20 --no-cold-start --out $R/$i-tune.json ) > $R/$i-tune-$c.log 2>&1
      grep -E "ms/step" $R/$i-tune-$c.log | head -2; grep -i -E "attention|fastest" $R/$i-tune-$c.log | head -20 ;;
    set) export $b=$c; echo "== $b=$c" ;;
    bgtests) mkdir -p /tmp/tt; ( for t in ${b//,/ }; do xz -dc .device/b/tests-$t.xz > /tmp/tt/$t && chmod +x /tmp/tt/$t
        ( cd /tmp && BASTILE_TEST_RUNTIMES=cuda timeout ${WAIT:-300} /tmp/tt/$t --test-threads ${TT:-2} ${c//,/ } > $R/tests-$t.log 2>&1; echo "rc $?" >> $R/tests-$t.log ) & done; wait ) & BG=$! ;;
    wait) wait $BG; for t in $R/tests-*.log; do echo "== $t"; grep -E "test result|panicked|FAILED|rc " $t | tail -8; done ;;
    sweep) bench $b $i-sweep-$b $w/$b --runtime ${RT:-cuda} --model $c --seq $d --batch ${SWEEP_BATCH:-1,4} --impl bastile --steps ${SWEEP_STEPS:-10} --no-cold-start ${SWEEP_ARGS:-} --out $R/$i-sweep.json ;;
    optrace) d=/tmp/caches-$b; mkdir -p $d   # optrace:build:op:ITEMS
      ( cd $d && env BASTILE_ADAMW_ITEMS=$d0 KERNEL_TRACE_OUT=$R/k-$i.txt CUDA_INJECTION64_PATH=/tmp/libkt.so BASTILE_KERNEL_CACHE=$d/kernels CUDA_CACHE_PATH=$d/cuda XDG_CACHE_HOME=$d/xdg \
        timeout 200 $w/$b --runtime cuda --op $c --out $R/$i-optrace-$c-$d0.json ) > $R/$i-optrace-$c-$d0.log 2>&1
      echo "== $i optrace $c items $d0: $(python3 benches/results/adamw-h200/norm-cubes/step_busy.py $R/k-$i.txt 2>&1 | tail -1)"; xz -T4 $R/k-$i.txt ;;
    sdpa) python3 benches/python/attention_torch.py --seq ${SDPA_SEQ:-2048,4096,8192,16384} --out $R/$i-sdpa.jsonl > $R/$i-sdpa.log 2>&1; tail -8 $R/$i-sdpa.log ;;
    perf) bench $b $i-perf-$b-$c-$d $P record -e cpu-clock -F 1999 -D ${PERF_DELAY:-0} -o /tmp/perf-$i.data -- $w/$b --runtime ${RT:-cuda} --model $c --seq $d --batch 1 --impl bastile --steps ${PSTEPS:-30} --no-cold-start --out $R/$i-perf.json
      $P report -i /tmp/perf-$i.data --stdio --sort comm --percent-limit 0.5 > $R/$i-perf-comm.txt 2>&1
      $P report -i /tmp/perf-$i.data --stdio --sort comm,sym --percent-limit 0.2 > $R/$i-perf-sym.txt 2>&1
      for t in DSD-0-0 DSU-0-0 $b; do $P report -i /tmp/perf-$i.data --stdio --comm $t --sort sym --percent-limit 0.3 > $R/$i-perf-$t.txt 2>&1; done; grep "%" $R/$i-perf-comm.txt | head -5 ;;
    perfg) bench $b $i-perfg-$b-$c-$d $P record -e cpu-clock -F 499 --call-graph dwarf,16384 -D ${PERF_DELAY:-0} -o /tmp/perfg-$i.data -- $w/$b --runtime ${RT:-cuda} --model $c --seq $d --batch 1 --impl bastile --steps ${PSTEPS:-30} --no-cold-start --out $R/$i-perfg.json
      for t in DSD-0-0 $b; do $P report -i /tmp/perfg-$i.data --stdio --no-children --comm $t --sort dso > $R/$i-perfg-dso-$t.txt 2>&1
        $P report -i /tmp/perfg-$i.data --stdio --children --comm $t --sort sym --percent-limit 1.5 -g caller,1,callee,function,percent > $R/$i-perfg-tree-$t.txt 2>&1; done
      grep "%" $R/$i-perfg-dso-DSD-0-0.txt | head -8 ;;
    *) if [ $b = op ]; then bench $a $i-$a-op-$c $w/$a --runtime cuda --op $c ${OPARGS:-} --out $R/$i-$a-op-$c.json
       else bench $a $i-$a-$b-$c $w/$a --runtime ${RT:-cuda} --model $b --seq $c --batch ${BATCH:-1} --impl bastile --steps ${d:-20} --no-cold-start --out $R/$i-$a-$b-$c.json; fi ;;
  esac
done
tar -C $OUT -cJf $OUT/r-${TAG:-ab}.tar.xz r && rm -rf $R
