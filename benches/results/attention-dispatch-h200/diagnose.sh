#!/usr/bin/env bash
# Attention diagnostics: op bench with system cuDNN and torch's, kernel+API traces of both sides.
set -u
R=$OUT/r; mkdir -p $R; w=/tmp/w; mkdir -p $w
B=${B:-bench-main}
[ -x $w/$B ] || { xz -dc .device/b/$B.xz > $w/$B && chmod +x $w/$B; }
TL=$(python3 -c "import nvidia,os;print(os.path.join(list(nvidia.__path__)[0],'cudnn','lib'))")
mkdir -p /tmp/cudnn-torch; ln -sfn $TL/libcudnn.so.9 /tmp/cudnn-torch/libcudnn.so
inc=$(dirname $(find /usr/local -name cupti_activity.h | head -1)); lib=$(dirname $(find /usr/local -name 'libcupti.so*' | head -1))
[ -f /tmp/libkt.so ] || gcc -O2 -shared -fPIC -DKTYPE=CUpti_ActivityKernel10 -I$inc benches/cupti/kernel_trace.c -L$lib -lcupti -Wl,-rpath,$lib -o /tmp/libkt.so
export LD_LIBRARY_PATH=$lib:${LD_LIBRARY_PATH:-}
d=/tmp/cache; mkdir -p $d; export BASTILE_KERNEL_CACHE=$d/k CUDA_CACHE_PATH=$d/c
SEQ=${SEQ:-2048,4096,8192}
for step in ${STEPS:-sys torch ktrace sdpa sdpakt}; do
  case $step in
  sys) timeout 200 $w/$B --runtime cuda --op attention --impl bastile --seq $SEQ --out $R/sys.json > $R/sys.log 2>&1; grep "attention hq" $R/sys.log ;;
  torch) LD_LIBRARY_PATH=/tmp/cudnn-torch:$TL:$LD_LIBRARY_PATH timeout 200 $w/$B --runtime cuda --op attention --impl bastile --seq $SEQ --out $R/torchdnn.json > $R/torchdnn.log 2>&1; grep -E "attention hq|cuDNN" $R/torchdnn.log | head; grep -h cuDNN $R/torchdnn.json | head -2 ;;
  ktrace) KERNEL_TRACE_API=1 KERNEL_TRACE_OUT=$R/kt-bastile.txt CUDA_INJECTION64_PATH=/tmp/libkt.so timeout 200 $w/$B --runtime cuda --op attention --impl bastile --seq 2048 --out $R/kt.json > $R/kt.log 2>&1; grep -E "attention hq|bastile:" $R/kt.log ;;
  sdpa) python3 benches/python/attention_torch.py --seq $SEQ > $R/sdpa.log 2>&1; grep "attention hq" $R/sdpa.log ;;
  perf) [ -d /tmp/perfb ] || tar -C /tmp -xJf .device/perfb.tar.xz
    P="/tmp/perfb/lib/ld-linux-x86-64.so.2 --library-path /tmp/perfb/lib /tmp/perfb/perf"
    timeout 300 $P record -e cpu-clock -F 999 --call-graph dwarf,16384 -o /tmp/perf.data -- $w/$B --runtime cuda --op attention --impl bastile --seq 2048 --calls ${CALLS:-50} --out $R/perf.json > $R/perf.log 2>&1; grep "attention hq" $R/perf.log
    $P report -i /tmp/perf.data --stdio --sort comm --percent-limit 0.5 > $R/perf-comm.txt 2>&1
    $P report -i /tmp/perf.data --stdio --no-children --sort comm,dso,sym --percent-limit 0.3 > $R/perf-sym.txt 2>&1
    $P report -i /tmp/perf.data --stdio --children --sort comm,sym --percent-limit 2 -g caller,0.5,callee,function,percent > $R/perf-tree.txt 2>&1
    grep "%" $R/perf-comm.txt | head -8 ;;
  fuselog) BURN_FUSION_LOG=full timeout 200 $w/$B --runtime cuda --op attention --impl bastile --seq 2048 --out $R/fl.json > $R/fuselog.log 2>&1; grep "attention hq" $R/fuselog.log; wc -l $R/fuselog.log; xz -T4 $R/fuselog.log ;;
  blocks1) mkdir -p /tmp/b1 && printf '[fusion.beam_search]\nmax_blocks = 1\n' > /tmp/b1/burn.toml && ( cd /tmp/b1 && timeout 200 $w/$B --runtime cuda --op attention --impl bastile --seq $SEQ --out $R/b1.json ) > $R/blocks1.log 2>&1; grep "attention hq" $R/blocks1.log ;;
  calls50) timeout 200 $w/$B --runtime cuda --op attention --impl bastile --seq $SEQ --calls 50 --out $R/c50.json > $R/calls50.log 2>&1; grep "attention hq" $R/calls50.log ;;
  sdpakt) KERNEL_TRACE_API=1 KERNEL_TRACE_OUT=$R/kt-sdpa.txt CUDA_INJECTION64_PATH=/tmp/libkt.so python3 benches/python/attention_torch.py --seq 2048 > $R/sdpakt.log 2>&1; grep "attention hq" $R/sdpakt.log ;;
  esac
done
for f in $R/kt-*.txt; do [ -f $f ] && xz -T4 $f; done
tar -C $OUT -cJf $OUT/r-${TAG:-x}.tar.xz r && rm -rf $R
