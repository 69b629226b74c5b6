"""`python tests/helpers/scripted_serve.py MODEL_DIR STEP_S -- FLAGS...`: the server's command line
(`jaxllm.serve`'s flags, signals and shutdown) serving the tiny chat checkpoint at MODEL_DIR with
answers from a script (`tiny_chat.ScriptedEngine`: each prompt answered with the same long text),
each decode step taking STEP_S seconds, so that requests are still running when a test signals it.
STEP_S 0: the real model, warm-up and all."""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import tiny_chat  # noqa: E402

import jaxllm  # noqa: E402
from jaxllm.serve.__main__ import bind, parse_args, serve, setup_logging  # noqa: E402


def main(model_dir: str, step_s: float, flags: list[str]) -> int:
    args = parse_args(["--model-dir", model_dir, "--quant", "none", "--dtype", "float32", *flags])
    sock = bind(args.host, args.port)
    setup_logging(args)
    engine = jaxllm.load(config=args.config)
    if step_s > 0:
        answer = engine.tokenizer.encode("word " * 400)
        engine = tiny_chat.ScriptedEngine(engine, lambda ids: answer, step_s=step_s)
    return serve(engine, args, sock)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], float(sys.argv[2]), sys.argv[sys.argv.index("--") + 1:]))
