#!/usr/bin/env bash
# Host profile of training steps with a carried perf: per thread and symbol (flat), then call graphs (dwarf).
# env BUILD (unstripped bench), MODEL, SEQ, STEPS, TAG.
set -u
R=$OUT/r; mkdir -p $R
w=/tmp/w; mkdir -p $w
b=${BUILD:-bench-sym}
[ -x $w/$b ] || { xz -dc .device/b/$b.xz > $w/$b && chmod +x $w/$b; }
[ -d /tmp/perfb ] || tar -C /tmp -xJf .device/perfb.tar.xz
P="/tmp/perfb/lib/ld-linux-x86-64.so.2 --library-path /tmp/perfb/lib /tmp/perfb/perf"
{ cat /proc/sys/kernel/perf_event_paranoid; uname -a; nproc; nvidia-smi --query-gpu=name --format=csv,noheader; } > $R/env.txt
$P record -e cpu-clock -F 999 -o /tmp/t.data -- sleep 0.2 > $R/perf-test.log 2>&1; echo "rc $?" >> $R/perf-test.log
cat $R/perf-test.log
d=/tmp/caches-$b; mkdir -p $d
args="--model ${MODEL:-qwen3-0.6b} --seq ${SEQ:-2048} --batch 1 --impl bastile --steps ${STEPS:-40} --no-cold-start"
bench() { # tag perf-args...
  local tag=$1; shift
  ( cd $d && BASTILE_KERNEL_CACHE=$d/kernels CUDA_CACHE_PATH=$d/cuda XDG_CACHE_HOME=$d/xdg timeout 300 "$@" $w/$b --runtime cuda $args --out $R/$tag.json > $R/$tag.log 2>&1 ); echo "rc $?" >> $R/$tag.log
  echo "== $tag"; grep -E "ms/step|host|error|panick|rc " $R/$tag.log | head -8
}
bench plain
bench flat $P record -e cpu-clock -F 1999 -o /tmp/flat.data --
$P report -i /tmp/flat.data --stdio --sort comm --percent-limit 0.5 > $R/flat-comm.txt 2>&1
$P report -i /tmp/flat.data --stdio --sort comm,dso,sym --percent-limit 0.15 > $R/flat-sym.txt 2>&1
head -40 $R/flat-comm.txt
bench dwarf $P record -e cpu-clock -F 499 --call-graph dwarf,16384 -o /tmp/dwarf.data --
$P report -i /tmp/dwarf.data --stdio --no-children --sort comm,sym --percent-limit 0.7 -G > $R/dwarf-callers.txt 2>&1
$P report -i /tmp/dwarf.data --stdio --children --sort comm,sym --percent-limit 2 -g none > $R/dwarf-children.txt 2>&1
ls -la /tmp/*.data
tar -C $OUT -cJf $OUT/r-${TAG:-perf}.tar.xz r && rm -rf $R
