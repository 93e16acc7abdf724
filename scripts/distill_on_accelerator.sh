#!/usr/bin/env bash
# One-shot draft distillation on an accelerator: SmolLM2's samples and the draft's training in one
# run of `jaxsr train distill` (configs/train/distill_smollm2_draft_h200.yaml; extra key=value
# arguments override it). Prints the wall time and the λ curve; the draft lands in OUTPUT_DIR/final.
#   pip install -U "jax[cuda13]" && pip install -e .    # once, in a clone
#   bash scripts/distill_on_accelerator.sh [key=value ...]
set -euo pipefail
OUTPUT_DIR=${OUTPUT_DIR:-out/distill_smollm2_draft_h200}
python3 -c "import jax; print('devices:', jax.devices())"
start=$(date +%s)
jaxsr train distill configs/train/distill_smollm2_draft_h200.yaml output_dir="$OUTPUT_DIR" "$@"
echo "wall: $(( $(date +%s) - start )) s"
python3 - "$OUTPUT_DIR/distill.json" <<'PY'
import json, sys
report = json.load(open(sys.argv[1]))
for h in report["history"]:
    print(f"step {h['step']:>5}  tokens {h['tokens']:>10}  loss {h['loss']:.3f}  λ {h['lambda']:.3f}")
print("cost ratio c:", report.get("cost_ratio"), " walls:", report["wall_s_this_call"])
PY
