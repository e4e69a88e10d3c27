#!/usr/bin/env bash
# soak.sh — run the heterogeneous-job and requeue tests N times on the dev Slurm cluster; count per test.
#
#   sudo tools/slurm-dev-cluster.sh start && tools/soak.sh 10           # N loops (default 5)
#   SOAK_FILES=tests/slurm/test_submit.py SOAK_K="disjoint_submit_is or crashing" tools/soak.sh 20   # another selection
#
# Each loop is one pytest run with its own --basetemp and JUnit report under ${SOAK_DIR:-/tmp/yatt-soak}.
# The table counts, per test: passed, failed, and "srun ended" (the launcher's StepWatch ended a
# srun that had not returned after every rank exited: the Slurm < 24.11 het-step hang, caught) and
# "hung" (a test that hit its time limit: something waited that nothing bounded). Exit 1 on any
# failure or hang. Every loop's log stays in SOAK_DIR for a post-mortem.
set -uo pipefail
cd "$(dirname "$0")/.."
N=${1:-5}
DIR=${SOAK_DIR:-/tmp/yatt-soak}
PY=${VENV:-.venv}/bin/python
read -r -a FILES <<< "${SOAK_FILES:-tests/slurm/test_submit.py tests/slurm/test_requeue.py}"
K=${SOAK_K:-disjoint or crashing or requeue or preempted or sigkilled}
LIMIT=${SOAK_TEST_TIMEOUT:-900}
rm -rf "$DIR" && mkdir -p "$DIR"
command -v squeue >/dev/null || { echo "soak: no Slurm here (start it: sudo tools/slurm-dev-cluster.sh start)" >&2; exit 2; }

for i in $(seq 1 "$N"); do
  start=$(date +%s)
  # the selection is split on spaces except the -k expression, which pytest takes whole
  timeout --kill-after=30 "$LIMIT" "$PY" -m pytest -q -p no:cacheprovider --basetemp="$DIR/loop-$i" \
    --junitxml="$DIR/loop-$i.xml" "${FILES[@]}" -k "$K" >"$DIR/loop-$i.log" 2>&1
  rc=$?
  [ "$rc" = 124 ] || [ "$rc" = 137 ] && echo "timeout" > "$DIR/loop-$i.timeout"
  echo "soak loop $i/$N: rc=$rc in $(( $(date +%s) - start ))s"
done

"$PY" - "$DIR" "$N" <<'PY'
import json, pathlib, sys
import xml.etree.ElementTree as ET
root, n = pathlib.Path(sys.argv[1]), int(sys.argv[2])
rows, ended, hung_loops = {}, 0, 0
for i in range(1, n + 1):
    xml = root / f"loop-{i}.xml"
    if (root / f"loop-{i}.timeout").exists() or not xml.exists():
        hung_loops += 1
        continue
    for case in ET.parse(xml).getroot().iter("testcase"):
        name = case.get("name")
        row = rows.setdefault(name, {"passed": 0, "failed": 0, "skipped": 0})
        kinds = {c.tag for c in case}
        row["failed" if kinds & {"failure", "error"} else "skipped" if "skipped" in kinds else "passed"] += 1
    for log in (root / f"loop-{i}").rglob("job_*.log"):
        ended += log.read_text(errors="replace").count("ending srun")
summaries = [json.loads(p.read_text()) for i in range(1, n + 1) for p in (root / f"loop-{i}").rglob("summary_*.json")]
jobs, het = len(summaries), sum(s["mode"] == "disjoint" for s in summaries)
width = max([len(k) for k in rows] + [4])
print(f"\n{'test':<{width}}  passed  failed  skipped")
for name, row in sorted(rows.items()):
    print(f"{name:<{width}}  {row['passed']:>6}  {row['failed']:>6}  {row['skipped']:>7}")
print(f"\nloops: {n}, loops that hit the time limit (hung): {hung_loops}; launcher summaries (job starts): {jobs}; "
      f"of them heterogeneous: {het}; srun ended by the launcher after every rank exited: {ended}")
summary = {"loops": n, "hung_loops": hung_loops, "job_starts": jobs, "het_job_starts": het, "srun_ended": ended, "tests": rows}
(root / "soak.json").write_text(json.dumps(summary, indent=1))
sys.exit(1 if hung_loops or any(r["failed"] for r in rows.values()) else 0)
PY
