#!/usr/bin/env bash
# rematc on one NVIDIA GPU, from a bare machine with torch installed and no network:
# the GPU tests, then bench/gpu_check.py on the test GPT, gpt2_sdpa and a Llama-7B-shaped
# stack (offload against recompute-only). Results (Markdown and CSV, and each part's log)
# go into the folder given as the first argument, the parts' output into parts.log there.
#
#   bash bench/gpu_check.sh OUT [WHEELS [PART...]]
#
# PARTS: gpt2_sdpa gpt_test gpt_dropout llama_offload tests (by default), and wholestep (the
# whole step's memory, bench/wholestep.py --device cuda), auto and auto_bf16 (bench/gpu_auto.py,
# fp32 and bf16 autocast) and llama_stack (eight Llama-2-7B layers at checkpointing's peak,
# offload against recompute-only, with the host link's measured bandwidth) and regions (an
# 8-layer transformers Llama 2048 wide, bench/regions.py: rematc regions=True at HF
# checkpointing's measured peak and at 0.8 of it, against HF checkpointing and the default
# regional compile) when named.
# WHEELS (default .whl) holds wheels of what the machine lacks (ortools, immutabledict,
# protobuf); they are installed into a scratch folder put first on PYTHONPATH. Each part
# has its own time limit, so the default parts end within 10 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: bash bench/gpu_check.sh OUT [WHEELS [PART...]]}
wheels=${2:-.whl}
shift $(($# < 2 ? $# : 2))
parts=${*:-gpt2_sdpa gpt_test gpt_dropout llama_offload tests}
mkdir -p "$out"
start=$SECONDS

site=${TMPDIR:-/tmp}/rematc-site
if compgen -G "$wheels/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" "$wheels"/*.whl \
        || exit 1
    export PYTHONPATH="$site:."
else
    export PYTHONPATH=.
fi
export PYTHONUNBUFFERED=1
python3 -c "import torch, ortools, rematc; print('torch', torch.__version__, torch.cuda.get_device_name())" \
    2>&1 || exit 1

part() {  # part NAME SECONDS COMMAND...: one part under its time limit, its log in OUT
    local name=$1 limit=$2; shift 2
    [[ " $parts " == *" $name "* ]] || return 0
    echo "== $name (limit ${limit} s, at $((SECONDS - start)) s)"
    echo "== $name" >>"$out/parts.log"
    timeout "$limit" "$@" >"$out/$name.part" 2>&1
    echo "== $name: exit $? after $((SECONDS - start)) s"
    cat "$out/$name.part" >>"$out/parts.log"
    grep -v "^ *\(warnings.warn\|planned, problem\)" "$out/$name.part" | tail -n 25
    rm -f "$out/$name.part"
}

part gpt2_sdpa 150 python3 -m bench.gpu_check "$out" --model gpt2_sdpa --deadline 110
part gpt_test 100 python3 -m bench.gpu_check "$out" --model gpt_test --deadline 65
part gpt_dropout 60 python3 -m bench.gpu_check "$out" --model gpt_dropout --deadline 35
part llama_offload 80 python3 -m bench.gpu_check "$out" --model llama_offload --deadline 45
part llama_stack 420 python3 -m bench.gpu_check "$out" --model llama_stack --deadline 300 --time-limit 15
part wholestep 300 python3 -m bench.wholestep --device cuda --out "$out/wholestep-cuda.md"
part auto 240 python3 -m bench.gpu_auto "$out"
part auto_bf16 240 python3 -m bench.gpu_auto "$out" --precision bf16-mixed
part regions 520 python3 -m bench.regions --layers 8 --hidden 2048 --seq 1024 --batch 4 --device cuda \
    --shares 1.0 0.8 --only hf_ckpt compile_regional rematc_regions --out "$out"
part tests 200 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k "not harness"
echo "== done in $((SECONDS - start)) s"
