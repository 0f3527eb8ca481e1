set -u
mkdir -p /tmp/w $OUT
for b in tcu tm; do [ -x /tmp/w/$b ] || { xz -dc .device/g/$b.xz > /tmp/w/$b && chmod +x /tmp/w/$b; }; done
lib=$(dirname $(find /usr/local -name 'libcupti.so*' | head -1)); export LD_LIBRARY_PATH=$lib:${LD_LIBRARY_PATH:-}
( cd bastile-cubecl && BASTILE_TEST_RUNTIMES=cuda timeout 300 /tmp/w/tcu --test-threads 8 ${KF:-adamw cuda_graph} > $OUT/tcu.log 2>&1; echo "rc $?" >> $OUT/tcu.log )
grep -E "^test |test result|panicked|rc " $OUT/tcu.log | tail -30
( cd models && BASTILE_TEST_RUNTIMES=cuda timeout 300 /tmp/w/tm --test-threads 1 --nocapture ${MF:-step_graphs} > $OUT/tm.log 2>&1; echo "rc $?" >> $OUT/tm.log )
grep -E "^test |test result|panicked|rc |bastile:|plain|graphs|largest|clone" $OUT/tm.log | tail -30
