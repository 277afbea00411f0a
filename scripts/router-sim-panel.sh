#!/usr/bin/env bash
# The router's simulator panel (docs/design.md): one policy over
# 60 cases on 4 simulated nodes -- the four generated workloads under Poisson arrivals (50 %
# and 80 % of capacity) and 16 closed-loop clients, and MMLU one at a time (2 ms, skewed, a
# 20k-token cache; speeds fitted to a real run at 2 ms, 200 ms and 1 s; gpu-70b) and with 4
# and 16 clients. Deterministic: run it for two trees and compare the lines.
#
#   scripts/router-sim-panel.sh MMLU_DIR OUT_DIR [POLICY]      (POLICY: cost by default)
#
# Then the same 12 workload cases with each request's entry node drawn at random (seeded,
# `--entry random`) instead of the generators' round-robin / per-conversation entries
# ("... rand"): with
# round-robin entry every node of `none` sees evenly thinned arrivals (`none` is then a
# round-robin balancer), which clients spread by DNS or an L4 balancer do not give.
# Last, the 24 workload cases again with the fitted speeds ("... fit"): the tiny engine's
# speeds on this loaded 2-core machine, where a warm request takes 0.1-0.2 s and a cold one
# 0.4 s instead of 14 and 46 ms, so a cache miss weighs less against a queue. These are the
# cases that reproduce the real cluster's agentic losses to `none` with round-robin entry
# (1.30x `none` at 80 % on the real cluster of 2cf4063, 1.27x with the fitted speeds; the
# default speeds never showed it).
#
# Writes OUT_DIR/traces/*.jsonl once (the bench's own generators; traces written before
# 12be853 replay chat and agentic without waiting for answers: use a fresh OUT_DIR) and
# prints one line per case: the case, then `radixmesh sim`'s summary row (mean s, p99 s, hit
# rates, hotspot, forwarded share, errors, gossip bytes). One seed per case (SEED=N: every case with
# `--seed N`): on the loaded cases the same router measured with other seeds moves by up to
# ±10 %, so compare trees on several seeds before trusting a difference of a few percent:
#   for s in $(seq 1 10); do SEED=$s scripts/router-sim-panel.sh MMLU OUT; done > a.txt
#   (the same for the other tree into b.txt), then scripts/panel-compare.py a.txt b.txt
set -euo pipefail
MMLU=${1:?usage: router-sim-panel.sh MMLU_DIR OUT_DIR [POLICY]}
OUT=${2:?usage: router-sim-panel.sh MMLU_DIR OUT_DIR [POLICY]}
POLICY=${3:-cost}
HERE=$(cd "$(dirname "$0")" && pwd)
FIT="$HERE/../docs/data/costmodel-tiny-loaded.json"  # `radixmesh sim --validate` of a 200 ms run
RM=${RADIXMESH:-radixmesh}
mkdir -p "$OUT/traces"
for w in agentic hotprefix rag chat; do
  [ -s "$OUT/traces/$w.jsonl" ] || "$RM" bench --workload "$w" --requests 400 \
      --synthetic-scale 0.25 --mmlu-dir "$MMLU" --export-trace "$OUT/traces/$w.jsonl" \
      --out "$OUT/export" > /dev/null
done
one() {
  printf "%-28s %s\n" "$1" "$("$RM" sim --nodes 4 --policy "$POLICY" --quiet --no-records \
      ${SEED:+--seed "$SEED"} "${@:2}" 2>&1 | tail -1)"
}
workloads() {  # ENTRY LABEL [more sim args]
  for w in agentic hotprefix rag chat; do
    for l in 0.5 0.8; do
      one "$w$2 p$l" --trace "$OUT/traces/$w.jsonl" --entry "$1" --load "$l" \
          --cache-tokens 60000 "${@:3}"
    done
    one "$w$2 k16" --trace "$OUT/traces/$w.jsonl" --entry "$1" --schedule sequential \
        --concurrency 16 --cache-tokens 60000 "${@:3}"
  done
}
workloads given ""
M=(--mmlu-dir "$MMLU" --requests 500 --schedule sequential)
one "mmlu seq" "${M[@]}"
one "mmlu seq skew" "${M[@]}" --skew skewed
one "mmlu seq 20k" "${M[@]}" --cache-tokens 20000
F=(--cost-model "$FIT" --max-context 4096)
for d in 2ms 200ms 1s; do one "fit seq $d" "${M[@]}" --net-delay "$d" "${F[@]}"; done
one "fit seq skew" "${M[@]}" "${F[@]}" --skew skewed
one "fit seq 20k" "${M[@]}" "${F[@]}" --cache-tokens 20000
for d in 2ms 1s; do one "g70 seq $d" "${M[@]}" --net-delay "$d" --cost-model gpu-70b; done
one "fit mmlu k4" "${M[@]}" --concurrency 4 "${F[@]}"
one "fit mmlu k16" "${M[@]}" --concurrency 16 "${F[@]}"
workloads random " rand"
workloads given " fit" "${F[@]}"
workloads random " rand fit" "${F[@]}"
