"""lm-evaluation-harness against ``deepinfer serve``: start the server, wait for /health, run
lm-eval's ``local-completions`` (or ``local-chat-completions``) model on the tasks asked, print
lm-eval's table, save its results as JSON, and stop the server (on errors and Ctrl-C too).

    python eval/run.py --tasks python_snippets --limit 12            # the local task, default model
    python eval/run.py --model /path/to/ckpt --accelerator nvidia --tasks gsm8k,mmlu

See eval/README.md. Needs ``pip install -e .[eval]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
SERVED_NAME = "deepinfer-eval"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint directory or HF repo id to serve (default: the embedded default model)")
    p.add_argument("--tokenizer", default=None,
                   help="HF tokenizer lm-eval counts tokens with (default: --model, or the default model's)")
    p.add_argument("--accelerator", default=None, help="deepinfer serve --accelerator (default: automatic)")
    p.add_argument("--dtype", default=None, help="deepinfer serve --dtype")
    p.add_argument("--port", type=int, default=0, help="port to serve on (default: a free one)")
    p.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                   help="one more argument for deepinfer serve, e.g. --serve-arg=--max-model-len=8192 (repeat)")
    p.add_argument("--tasks", required=True, help="comma-separated lm-eval tasks, groups or tags (e.g. python_snippets, gsm8k)")
    p.add_argument("--include-path", default=str(HERE / "tasks"), help="extra task YAMLs (default: eval/tasks)")
    p.add_argument("--api", choices=["completions", "chat"], default="completions",
                   help="completions: local-completions on /v1/completions (loglikelihood and generation tasks); "
                        "chat: local-chat-completions on /v1/chat/completions with the chat template (generation tasks only)")
    p.add_argument("--num-fewshot", type=int, default=None)
    p.add_argument("--limit", type=float, default=None, help="at most this many items per task (a fraction if < 1)")
    p.add_argument("--max-gen-toks", type=int, default=256, help="lm-eval's default generation length (a task's own wins)")
    p.add_argument("--max-length", type=int, default=2048, help="lm-eval's context length for the requests it builds")
    p.add_argument("--num-concurrent", type=int, default=1, help="requests lm-eval keeps in flight")
    p.add_argument("--no-bos", action="store_true", help="send prompts without the tokenizer's BOS (lm-eval's own default)")
    p.add_argument("--confirm-run-unsafe-code", action="store_true",
                   help="let tasks that execute the model's code run (humaneval; lm-eval's flag)")
    p.add_argument("--log-samples", action="store_true", help="keep every request and response in the JSON (as 'samples')")
    p.add_argument("--output", default="eval_results.json", help="where lm-eval's results go, as JSON")
    p.add_argument("--startup-timeout", type=float, default=600, help="seconds to wait for /health")
    return p.parse_args(argv)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_command(args: argparse.Namespace, port: int) -> list[str]:
    cmd = [sys.executable, "-m", "deepinfer_core.cli", "serve"] + ([args.model] if args.model else [])
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--served-model-name", SERVED_NAME]
    if args.accelerator:
        cmd += ["--accelerator", args.accelerator]
    if args.dtype:
        cmd += ["--dtype", args.dtype]
    return cmd + args.serve_arg


def wait_healthy(url: str, server: subprocess.Popen, log: Path, timeout: float) -> None:
    """Return once GET url/health answers 200; raise if the server exits or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"deepinfer serve exited with status {server.returncode} before it was healthy:\n{tail}")
        with contextlib.suppress(urllib.error.URLError, OSError):
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        time.sleep(0.5)
    raise TimeoutError(f"deepinfer serve did not answer {url}/health within {timeout:.0f} s (its log: {log})")


@contextlib.contextmanager
def running_server(args: argparse.Namespace, log: Path):
    """The base URL of a `deepinfer serve` started for args; stopped (SIGINT, then SIGKILL) on leaving."""
    port = args.port or free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = serve_command(args, port)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    env.pop("DEEPINFER_API_KEY", None)  # 127.0.0.1 only, and lm-eval would need the key too
    print(f"starting: {' '.join(cmd)}  (log: {log})", file=sys.stderr, flush=True)
    with open(log, "w") as out:
        # its own process group: the terminal's Ctrl-C reaches this script, which stops the server itself
        server = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        wait_healthy(url, server, log, args.startup_timeout)
        yield url
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGINT)  # uvicorn's graceful shutdown: the engine is closed
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


def model_arguments(args: argparse.Namespace, url: str) -> tuple[str, dict]:
    """lm-eval's model name and model_args for the server at url."""
    common = {"model": SERVED_NAME, "num_concurrent": args.num_concurrent, "max_retries": 1, "max_gen_toks": args.max_gen_toks,
              "max_length": args.max_length, "timeout": 600}
    if args.api == "chat":  # text in, text out: the server applies the chat template, lm-eval counts nothing
        return "local-chat-completions", {**common, "base_url": url + "/v1/chat/completions", "tokenizer_backend": "none"}
    if args.tokenizer:
        tokenizer = args.tokenizer
    elif args.model:
        tokenizer = args.model
    else:
        from deepinfer_core.config import DEFAULT_MODEL_DIR
        tokenizer = str(DEFAULT_MODEL_DIR)
    # token ids are sent (tokenized_requests): lm-eval's context / continuation boundary is then
    # exactly the server's, and the prompts start with BOS as the models were trained to see them
    return "local-completions", {**common, "base_url": url + "/v1/completions", "tokenizer": tokenizer,
                                 "tokenizer_backend": "huggingface", "tokenized_requests": True,
                                 "add_bos_token": not args.no_bos}


def evaluate(args: argparse.Namespace, url: str) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    model, model_args = model_arguments(args, url)
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    limit = int(args.limit) if args.limit is not None and args.limit >= 1 else args.limit
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=tasks, num_fewshot=args.num_fewshot,
                                   limit=limit, log_samples=args.log_samples, task_manager=TaskManager(include_path=args.include_path),
                                   apply_chat_template=args.api == "chat", confirm_run_unsafe_code=args.confirm_run_unsafe_code)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        from lm_eval.utils import handle_non_serializable, make_table
    except ImportError:
        print("error: lm-eval is not installed: pip install -e '.[eval]'", file=sys.stderr)
        return 1
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    log = output.with_suffix(".server.log")
    try:
        with running_server(args, log) as url:
            results = evaluate(args, url)
    except KeyboardInterrupt:
        print("interrupted: the server is stopped", file=sys.stderr)
        return 130
    except (RuntimeError, TimeoutError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if results is None:  # simple_evaluate returns None on ranks other than 0; one process here
        print("error: lm-eval returned no results", file=sys.stderr)
        return 1
    print(make_table(results))
    if "groups" in results:
        print(make_table(results, "groups"))
    output.write_text(json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False))
    print(f"results: {output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
