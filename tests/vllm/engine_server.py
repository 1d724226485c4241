"""A vLLM engine (TP2, backend "jreshard") serving JSON requests: generation and the weight-sync phases.

Started by tests/vllm/test_vllm_live.py as a process: ``engine_server.py MODEL_DIR PORT_FILE [DTYPE]``
(the model dtype, float32 unless given; an FP8 checkpoint is served in bfloat16). It writes its
listener's port to PORT_FILE once the engine is up. Requests (tests/vllm/_common.py):
``generate`` (greedy tokens and log-probabilities of token-id prompts), ``call`` (a method of
bridge.engines.vllm.LLMClient), ``pause``/``resume`` (generation waits while paused), ``version`` and ``stop``.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import traceback
from multiprocessing.connection import Listener

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.vllm import _common as C  # noqa: E402


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import WeightTransferConfig

    from bridge.engines.vllm import LLMClient

    model_dir, port_file = sys.argv[1], sys.argv[2]
    dtype = sys.argv[3] if len(sys.argv) > 3 else "float32"
    llm = LLM(model=model_dir, skip_tokenizer_init=True, dtype=dtype, enforce_eager=True,
              distributed_executor_backend="mp", max_model_len=256, tensor_parallel_size=C.TP,
              weight_transfer_config=WeightTransferConfig(backend="jreshard"))
    client = LLMClient(llm)
    lock = threading.Lock()  # one LLM call at a time
    resumed = threading.Event()
    resumed.set()
    stop = threading.Event()

    def generate(prompts: list[list[int]], max_tokens: int) -> list[dict]:
        resumed.wait()
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=1)
        with lock:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        result = []
        for o in outs:
            c = o.outputs[0]
            result.append({"tokens": list(c.token_ids),
                           "logprobs": [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs, strict=True)]})
        return result

    def handle(conn) -> None:
        with conn:
            req = json.loads(conn.recv_bytes().decode())
            op, args = req["op"], req["args"]
            try:
                if op == "generate":
                    result = generate(args["prompts"], args["max_tokens"])
                elif op == "call":
                    with lock:
                        result = getattr(client, args["method"])(*args["args"])
                elif op == "pause":
                    resumed.clear()
                    result = None
                elif op == "resume":
                    resumed.set()
                    result = None
                elif op == "version":
                    with lock:
                        result = client.get_weight_version()
                elif op == "stop":
                    stop.set()
                    result = None
                else:
                    raise ValueError(f"unknown op {op!r}")
                conn.send_bytes(json.dumps({"ok": True, "result": result}).encode())
            except Exception as e:
                traceback.print_exc()
                conn.send_bytes(json.dumps({"ok": False, "type": type(e).__name__, "error": str(e)}).encode())

    listener = Listener(("127.0.0.1", 0), authkey=C.AUTHKEY)
    with open(port_file + ".tmp", "w") as f:
        f.write(str(listener.address[1]))
    os.replace(port_file + ".tmp", port_file)
    while not stop.is_set():
        conn = listener.accept()
        threading.Thread(target=handle, args=(conn,), daemon=True).start()
    listener.close()
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
