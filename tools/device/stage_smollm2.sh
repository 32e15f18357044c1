# Sourced by the device scripts that need SmolLM2 (call 2 and later, after a call copied .stage/a/part_aa to $S):
# joins the GGUF halves, checks them, installs the carried gguf wheel, copies MT-Bench's questions (and EXTRA_STAGE
# files) to $S, and exports what eyas needs. STAGED=1: a dry run on the CPU, where SmolLM2 loads from the package.
S=${S:-/root/stage}; W=${W:-/root/w}; mkdir -p $W $OUT
if [ -z "${STAGED:-}" ]; then
  if [ -f $S/part_aa ]; then
    cat $S/part_aa .stage/b/part_ab > $S/smollm2.gguf && rm $S/part_aa
  fi
  echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $S/smollm2.gguf" | sha256sum -c || exit 1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .stage/b/*.whl || exit 1
  cp .stage/b/question.jsonl ${EXTRA_STAGE:-} $S/
fi
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD TOKENIZERS_PARALLELISM=true
[ -f $S/smollm2.gguf ] && export EYAS_SMOLLM2_GGUF=$S/smollm2.gguf
