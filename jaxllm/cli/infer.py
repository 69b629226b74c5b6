"""`python -m jaxllm.infer`: generate from prompts (or score a text) on any supported model."""

from __future__ import annotations

import json
import sys

from jaxllm.cli import distributed
from jaxllm.cli.common import add_engine_args, add_sampling_args, load_engine, one_line_errors
from jaxllm.cli.perplexity import add_perplexity_args, check_perplexity_args, run_perplexity
from jaxllm.config.engine import Parser, add_flags, from_args, positive_int, settle
from jaxllm.engine.request import check_sampling
from jaxllm.errors import RequestError

DEFAULT_PROMPT = "Write a haiku about the sea."
PROG = "jaxllm.infer"


def build_parser() -> Parser:
    p = Parser(prog=PROG, description="Generate text with jaxllm.")
    add_engine_args(p)
    p.add_argument("--prompt", action="append", help="a prompt; repeat for a batch")
    p.add_argument("--prompt-file", help="read one prompt from a file")
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens per sequence")
    p.add_argument("--batch", type=positive_int, default=None, help="lockstep batch size (prompts repeated)")
    add_sampling_args(p)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    template = p.add_mutually_exclusive_group()
    template.add_argument(
        "--chat", action="store_true", help="apply the chat template (default: only where the model is chat-tuned)"
    )
    template.add_argument(
        "--raw-prompt", action="store_true", help="no chat template (default where the model is not chat-tuned)"
    )
    add_flags(p, ("json",))
    add_perplexity_args(p)
    return p


def prompts_from(args) -> list[str]:
    prompts = list(args.prompt or [])
    if args.prompt_file:
        try:
            with open(args.prompt_file, encoding="utf-8") as f:
                prompts.append(f.read())
        except OSError as e:
            raise RequestError(f"cannot read --prompt-file {args.prompt_file}: {e.strerror}") from None
        except UnicodeDecodeError:
            raise RequestError(f"--prompt-file {args.prompt_file} is not UTF-8 text") from None
    prompts = prompts or [DEFAULT_PROMPT]
    if args.batch is not None:
        if args.batch < len(prompts):
            raise RequestError(f"--batch {args.batch} is smaller than the {len(prompts)} prompts given")
        prompts = [prompts[i % len(prompts)] for i in range(args.batch)]
    return prompts


def check_args(args):
    """Every flag, and the files they name, before JAX loads."""
    distributed.check_args(args)
    settle(args, from_args(args))  # what was not given reads as its default from here on
    if args.perplexity:
        check_perplexity_args(args)
    else:
        check_sampling(args.max_tokens, args.temperature, args.top_k, args.top_p)
        prompts_from(args)


def check_context(args):
    """The model's limits, from its config alone (JAX loads, no weight is read): the new tokens and
    a prompt of at least one token must fit the context, --max-ctx or the model's default."""
    from jaxllm.weights import read_config

    cfg = read_config(args.model_dir)
    ctx = args.max_ctx or cfg.default_ctx
    if not args.perplexity and args.max_tokens + 1 > ctx:
        raise RequestError(
            f"max_tokens {args.max_tokens} and a prompt of at least one token need more "
            f"positions than max_ctx {ctx}: lower --max-tokens to at most {ctx - 1} or "
            f"raise --max-ctx"
        )


def run_generate(args, eng):
    prompts = prompts_from(args)
    chat = True if args.chat else False if args.raw_prompt else None  # None: as the model is
    tok = eng.tokenizer
    if args.chat and tok is not None and tok.chat_template and not tok.chat_tuned:
        sys.stderr.write(f"{PROG}: note: {eng.name} is not chat-tuned; --chat applies its family's chat template\n")
    outs = eng.generate(
        prompts,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop=args.stop,
        chat=chat,
    )
    st = eng.stats
    ttft_ms = st.ttft_s * 1000
    # tokens after each row's first, over the loop's time (rows that stopped early count what they made)
    tok_s = (st.new_tokens - st.batch) / st.decode_s if st.decode_s > 0 else 0.0
    load_s = getattr(args, "load_s", 0.0)
    for p, c in zip(prompts, outs):
        if args.json:
            print(
                json.dumps(
                    {
                        "prompt": p,
                        "text": c.text,
                        "token_ids": c.token_ids,
                        "num_prompt_tokens": len(c.prompt_token_ids),
                        "num_new_tokens": len(c.token_ids),
                        "ttft_ms": round(ttft_ms, 3),
                        "decode_tok_s": round(tok_s, 3),
                        "finish_reason": c.finish_reason,
                        "load_s": round(load_s, 3),
                        "compile_s": round(st.compile_s, 3),
                        **({"speculation": st.spec} if st.spec else {}),
                    },
                    ensure_ascii=False,
                ),
                flush=True,
            )
        else:
            print(c.text if len(outs) == 1 else f"--- {p[:60]!r}\n{c.text}", flush=True)
    if not args.json:
        sys.stderr.write(
            f"[{eng.name}] batch {st.batch}: {st.prompt_tokens} prompt + {st.new_tokens} new tokens, "
            f"TTFT {ttft_ms:.1f} ms, decode {tok_s:.1f} tok/s; load {load_s:.1f} s, "
            f"compile {st.compile_s:.1f} s{st.spec_summary()}\n"
        )


def main(argv=None):
    args = build_parser().parse_args(argv)
    with one_line_errors(PROG):
        check_args(args)
        check_context(args)
        eng = load_engine(args, quiet=args.json)
        if args.perplexity:
            run_perplexity(args, eng)
        else:
            run_generate(args, eng)


if __name__ == "__main__":
    main()
