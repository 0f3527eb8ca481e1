set -u
bash .device/g/t.sh
mkdir -p $OUT/tests && cp $OUT/tcu.log $OUT/tm.log $OUT/tests/ 2>/dev/null
RUNS="1:1024:qwen3-0.6b 1:4096:llama-3.2-1b" TORCH="" TAG=more bash benches/results/step-graphs-h200/run.sh 2>&1 | tail -20
