"""The `--perplexity` part of the infer command line (the measure itself: `engine.perplexity`)."""

from __future__ import annotations

import json
import sys
from functools import partial
from pathlib import Path

from tqdm import tqdm

from jaxllm.engine.perplexity import PerplexityResult, check_window, perplexity
from jaxllm.errors import RequestError


def add_perplexity_args(parser) -> None:
    g = parser.add_argument_group("perplexity")
    g.add_argument("--perplexity", action="store_true", help="score a text file instead of generating")
    g.add_argument("--ppl-file", metavar="F", help="text file to score ('-' reads stdin)")
    g.add_argument(
        "--ppl-window", metavar="W", type=int, default=2048, help="tokens per window, counting the BOS (default 2048)"
    )
    g.add_argument(
        "--ppl-stride", metavar="S", type=int, default=None, help="tokens between window starts (default W/2)"
    )


def read_ppl_text(args) -> str:
    """The text to score, after checking the window flags."""
    check_window(args.ppl_window, args.ppl_stride)
    if not args.ppl_file:
        raise RequestError("--perplexity needs --ppl-file F (the text to score)")
    if args.ppl_file == "-":
        text = sys.stdin.read()
    else:
        p = Path(args.ppl_file)
        if not p.is_file():
            raise RequestError(f"--ppl-file {p}: no such file")
        try:
            text = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise RequestError(f"--ppl-file {p}: unreadable ({e})") from None
    if not text.strip():
        raise RequestError(f"--ppl-file {args.ppl_file}: the text is empty")
    return text


def check_perplexity_args(args) -> None:
    """Fail on bad flags or an unreadable file before a model is loaded; keeps the text on args."""
    args.ppl_text = read_ppl_text(args)


def run_perplexity(args, engine, text: str | None = None) -> PerplexityResult:
    """Score the file named by args and print the result: one JSON line with --json, else a summary."""
    if text is None:
        text = getattr(args, "ppl_text", None) or read_ppl_text(args)
    as_json = bool(getattr(args, "json", False))
    bar = None
    if not as_json:
        bar = tqdm(total=None, desc="perplexity", unit="window", file=sys.stderr, leave=False)
    res = perplexity(
        engine, text, args.ppl_window, args.ppl_stride, progress=partial(_advance, bar) if bar is not None else None
    )
    if bar is not None:
        bar.close()
    if as_json:
        print(json.dumps(res.to_json()), flush=True)
    else:
        print(
            f"perplexity {res.ppl:.4f}  (mean NLL {res.nll:.5f} over {res.num_scored_tokens} tokens, "
            f"window {res.window}, stride {res.stride})",
            flush=True,
        )
    return res


def _advance(bar, done: int, total: int) -> None:
    bar.total = total
    bar.n = done
    bar.refresh()
