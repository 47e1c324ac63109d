"""Generate text from a trained LLM run (mode=llm): see what it learned.

    python -m dit_train mode=llm hydra.run.dir=outputs/lm
    python -m dit_train.tools.generate outputs/lm --prompt "The with statement" --max-new 200          # greedy
    python -m dit_train.tools.generate outputs/lm --prompt "Lists are" --top-k 8 --temperature 0.8 --seed 1
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dit_train.data_pipelines.text import build_tokenizer
from dit_train.engine.checks import Range
from dit_train.generate import generate, load_run
from dit_train.tools.args import POSITIVE_FLOAT, POSITIVE_INT, ToolParser, ranged



def main(argv: list[str] | None = None) -> int:
    ap = ToolParser(prog="python -m dit_train.tools.generate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", help="a run dir holding config.yaml and weights.safetensors")
    ap.add_argument("--weights", default=None, help="another .safetensors (e.g. exported from a checkpoint)")
    ap.add_argument("--ema", action="store_true", help="use the run's EMA weights (weights_ema.safetensors)")
    ap.add_argument("--prompt", default="The ")
    ap.add_argument("--max-new", type=POSITIVE_INT, default=200)
    ap.add_argument("--top-k", type=ranged(int, Range(0, note="0 = greedy")), default=0, help="0 = greedy")
    ap.add_argument("--temperature", type=POSITIVE_FLOAT, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    try:
        cfg, model = load_run(args.run_dir, args.weights, args.ema)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if cfg.mode != "llm":
        print(f"error: {args.run_dir} trained mode={cfg.mode}; text generation needs a mode=llm run "
              f"(videos: python -m dit_train.tools.sample)", file=sys.stderr)
        return 2
    tok = build_tokenizer(cfg.data.tokenizer)
    out = generate(model, tok.encode(args.prompt), args.max_new, args.top_k, args.temperature, args.seed)
    print(tok.decode(out))
    return 0


if __name__ == "__main__":
    from dit_train.engine.process_exit import run_and_exit

    run_and_exit(main)
