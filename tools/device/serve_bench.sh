# `eyas serve` on the GPU as its clients see it (never measured there before session 68: the device's Python had
# no fastapi, starlette or uvicorn; `.whl` now carries them, opentelemetry-api, which fastapi needs, and httptools,
# which uvicorn takes as it takes the device's uvloop: eyas's dependencies since session 68). SmolLM2
# served with its shipped draft (the shipped dispatcher) and without a draft (`--draft none`), each loaded by
# `eyas bench serve` (httpx, on the device already): MT-Bench first turns x MAXTOK tokens, greedy, at each
# concurrency of CONC. The offline rows to hold them against: `eyas bench latency` at batch 1 (session 67, an H100:
# plain 0.427, the default tree 0.271 ms a token). Each server runs under tools/diag/serve_steps.py, which times the
# engine's steps inside it by batch size; `eyas bench latency` first times the same engines alone at the same batch
# sizes (OFFLINE=0 skips it): what serving costs a step, and what the client sees.
#
# Calls (staging as tools/device/README.md, "Session 67"): 1 carry .stage/a (cp part_aa to /root/stage), 2 carry
# .stage/b (cp part_ab), 3 carry .stage/c .whl: bash tools/device/serve_bench.sh (an estimated 5 minutes). Out: serve.md
# and serve.png (every run), serve_runs.json (each run's meta and summary, and each server's steps),
# offline_latency.{md,json}, the servers' logs.
# Knobs: CONC ("1 16 64"), N (80 prompts), MAXTOK (128), UP_S (seconds to wait for a server's /health, 300: the
# first process captures ~340 graphs, 89 s on an H100 in session 66), SERVERS ("spec plain"; "spec-eager" and
# "plain-eager": the same with --max-prefill-seqs 0, a wave of arrivals prefilled in one step, eagerly past 16
# sequences, as before session 68; "spec-si" and "plain-si": the interpreter's GIL switch interval at SWITCH_MS,
# 0.5 ms, in place of Python's 5; "spec-proc" and "plain-proc": --engine-process; "spec-proc-si" and
# "plain-proc-si": both; any of them + "-sN": with --stream-interval N, + "-wMS": with --prefill-wait-ms MS (both
# since session 72; "spec-proc-w2-s4"), + "-aN": with --api-server-count N (session 73; serve_steps.py watches the
# first HTTP process only), then + "-nogc": with EYAS_GC_FREEZE=0), SERVE_ARGS (added to every server and to
# the offline run, so only options both take, such as --device and --dtype), PROMPTS ($S/question.jsonl), CLIENTS
# (the client's processes, 8 since session 71 (4 in session 70), at most the concurrency: `eyas bench serve
# --client-processes`; one Python client was 76-98% busy at 16 and 64 before, 8 were 21-44% each in session 71).
# A CPU dry run: STAGED=1 S=/tmp/s W=/tmp/w OUT=/tmp/o N=2 MAXTOK=4
# CONC=1 SERVE_ARGS="--device cpu --dtype float32" PROMPTS=../shared/data/mt_bench/question.jsonl (the venv's
# python first on PATH).
source tools/device/thirds_lib.sh
if [ -z "${STAGED:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
fi
stage_thirds || exit 1  # it exports PYTHONPATH=/tmp/site:$PWD and PYTHONUNBUFFERED=1 (stage_smollm2.sh)
python3 -c "from importlib.metadata import version as v; import eyas.serve.api_server
print(*(f'{p} {v(p)}' for p in ('fastapi', 'starlette', 'uvicorn', 'anyio', 'httpx', 'pydantic')))" || exit 1
PROMPTS=${PROMPTS:-$S/question.jsonl}; PORT=${PORT:-8011}; R=$W/serve; mkdir -p $R
runs=()
# the shipped draft's dispatch for greedy steps (its config's first temperature band), as the server runs it
SPEC=${SPEC:-dispatch:2=tree:smollm2_48d5,16=dyn:k4d3n8,32=tree:8,256=chain:3}
if [ "${OFFLINE:-1}" = 1 ]; then
  echo "== offline: eyas bench latency, batch sizes ${CONC:-1 16 64} [t=$(el)]"
  python3 -m eyas.cli bench latency --model smollm2 --draft default --modes plain,$SPEC --max-tokens ${MAXTOK:-128} \
    --batch-sizes $(echo ${CONC:-1 16 64} | tr ' ' ,) --num-prompts ${N:-80} --prompts $PROMPTS --max-model-len 8192 \
    ${SERVE_ARGS:-} --out $W/offline > $W/offline.txt 2>&1 || tail -n 5 $W/offline.txt
  cp $W/offline/latency.md $OUT/offline_latency.md; cp $W/offline/latency.json $OUT/offline_latency.json
  cat $OUT/offline_latency.md
fi

serve_runs() {  # NAME SERVE-ARGS...: one server, loaded at each concurrency, then stopped
  local name=$1 c steps_args=() envs=(); shift
  case $name in *-si*) steps_args=(--switch-interval-ms ${SWITCH_MS:-0.5}) ;; esac
  case $name in *-nogc) envs=(env EYAS_GC_FREEZE=0) ;; esac
  echo "== $name: ${envs[*]} ${steps_args[*]} eyas serve $* ${SERVE_ARGS:-} [t=$(el)]"
  "${envs[@]}" python3 tools/diag/serve_steps.py --out $R/steps_$name.json "${steps_args[@]}" \
    -- --model smollm2 --port $PORT "$@" ${SERVE_ARGS:-} \
    > $OUT/server_$name.log 2>&1 &
  local pid=$! up=0
  for _ in $(seq ${UP_S:-300}); do
    if python3 -c "import httpx, sys; sys.exit(httpx.get('http://127.0.0.1:$PORT/health').status_code != 200)" \
        2> /dev/null; then up=1; break; fi
    kill -0 $pid 2> /dev/null || break
    sleep 1
  done
  if [ $up = 0 ]; then echo "$name: no server up [t=$(el)]"; tail -n 5 $OUT/server_$name.log; kill $pid; return 1; fi
  echo "$name: up [t=$(el)]"
  for c in ${CONC:-1 16 64}; do  # each run from an empty prefix cache: the runs before sent the same prompts
    python3 -c "import httpx; httpx.post('http://127.0.0.1:$PORT/reset_prefix_cache').raise_for_status()" || return 1
    local clients=$(( ${CLIENTS:-8} < c ? ${CLIENTS:-8} : c ))
    python3 -m eyas.cli bench serve --base-url http://127.0.0.1:$PORT/v1 --model smollm2 --prompts $PROMPTS \
      --num-prompts ${N:-80} --max-tokens ${MAXTOK:-128} --temperature 0 --concurrency $c --label $name-c$c \
      --client-processes $clients \
      --no-progress --out $R/$name-c$c --compare "${runs[@]}" > $R/$name-c$c.txt 2>&1 || tail -n 3 $R/$name-c$c.txt
    [ -f $R/$name-c$c/serve.json ] && runs+=($R/$name-c$c/serve.json)
  done
  kill -INT $pid; wait $pid
  grep "ms a step" $OUT/server_$name.log | grep -E "^(engine process: )?decode, batch (1|16|6[0-4]):"
  grep -E "^(engine process: )?latency: |^busy window" $OUT/server_$name.log
  grep -E -A2 "^(engine process: )?slow step" $OUT/server_$name.log | head -n 12 | cut -c1-200
  echo "$name: done [t=$(el)]"
}

for s in ${SERVERS:-spec plain}; do
  base=${s%-nogc} more=()  # any server's name + "-nogc": the same with EYAS_GC_FREEZE=0 (no frozen heap)
  while [[ $base =~ ^(.*)-([swa])([0-9.]+)$ ]]; do  # + "-sN" / "-wMS" / "-aN" (before any "-nogc"): with
    base=${BASH_REMATCH[1]}                       # --stream-interval N / --prefill-wait-ms MS / --api-server-count N
    case ${BASH_REMATCH[2]} in
      s) more+=(--stream-interval ${BASH_REMATCH[3]}) ;;
      w) more+=(--prefill-wait-ms ${BASH_REMATCH[3]}) ;;
      a) more+=(--api-server-count ${BASH_REMATCH[3]}) ;;
    esac
  done
  case $base in
    spec) args=(--draft default --no-engine-process) ;;  # the loop on a thread of the server's
    plain) args=(--draft none --no-engine-process) ;;
    # a wave of arrivals in one prefill step, eager past 16 sequences (before session 68)
    spec-eager) args=(--draft default --no-engine-process --max-prefill-seqs 0) ;;
    plain-eager) args=(--draft none --no-engine-process --max-prefill-seqs 0) ;;
    # the GIL's switch interval at SWITCH_MS (0.5) in place of 5 ms
    spec-si) args=(--draft default --no-engine-process) ;;
    plain-si) args=(--draft none --no-engine-process) ;;
    # the engine in a process of its own (serve_steps.py times its steps there: "engine process: ...")
    spec-proc) args=(--draft default --engine-process) ;;
    plain-proc) args=(--draft none --engine-process) ;;
    # both: the parent's switch interval (its command queue's feeder thread waits less for the event loop's GIL)
    spec-proc-si) args=(--draft default --engine-process) ;;
    plain-proc-si) args=(--draft none --engine-process) ;;
    *) echo "unknown server $s"; exit 1 ;;
  esac
  serve_runs $s "${args[@]}" "${more[@]}"
done
[ ${#runs[@]} -gt 0 ] || { echo "no run"; exit 1; }
last=$(dirname ${runs[-1]})
cp $last/serve.md $last/serve.png $OUT/
cat $OUT/serve.md
python3 - $R "${runs[@]}" > $OUT/serve_runs.json <<'EOF'
import json, sys, pathlib
steps = {p.stem[6:]: json.loads(p.read_text()) for p in pathlib.Path(sys.argv[1]).glob("steps_*.json")}
runs = [{k: json.load(open(p))[k] for k in ("meta", "summary")} for p in sys.argv[2:]]
print(json.dumps({"runs": runs, "server_steps": steps}, indent=1))
EOF
echo "done [t=$(el)]"
