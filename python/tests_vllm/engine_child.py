"""A vLLM engine (CPU, a tiny random model) driven line by line, for the tests of the connector.

    python engine_child.py MODEL_DIR [SOCKET]

Without SOCKET the engine runs without a KV connector (the reference tokens). It prints
``KVW-READY {...}`` once started, then for each JSON line on stdin
(``{"prompts": [[token ids], ...], "max_tokens": n}``, optionally
``"kill_at_first_load": PID``: SIGKILL that process when the generate's first step
starts loading) one ``KVW-RESULT {...}`` line:
the greedy tokens of each prompt and what the connector did during that generate.
vLLM's own output goes to stderr. The engine core runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so both connectors can be inspected.
"""

import json
import os
import signal
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

#: The tiny llama-like model of the tests: small enough for a CPU, big enough that a
#: wrong KV block changes the greedy tokens.
MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": 1024,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
BLOCK_SIZE = 32
#: The benchmarks' model (``python/benchmarks``): big enough that a 2,000-token prefill
#: takes a good part of a second on a CPU, so that loading it instead shows.
BENCH_MODEL_CONFIG = dict(
    MODEL_CONFIG,
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    vocab_size=8192,
    max_position_embeddings=8192,
)


#: Standard deviation of each weight kind (norms are 1). Big enough that every block
#: of the prompt changes the greedy tokens.
WEIGHT_STD = {"embed_tokens": 1.0, "self_attn": 0.3, "mlp": 0.1, "lm_head": 0.3}


def write_model(directory, config=None):
    """A model described by its config.json and seeded random weights, written here
    (nothing is downloaded). vLLM's load_format="dummy" would do without the weights
    file, but its values (uniform in ±1e-3) make the output independent of the
    prompt, and on CPU the linear layers are repacked at load, out of reach of a
    re-initialisation afterwards: the token comparisons would prove nothing."""
    import torch
    from safetensors.torch import save_file

    config = config or MODEL_CONFIG
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head = config["head_dim"]
    q_out = config["num_attention_heads"] * head
    kv_out = config["num_key_value_heads"] * head
    shapes = {
        "model.embed_tokens.weight": (config["vocab_size"], hidden),
        "model.norm.weight": (hidden,),
        "lm_head.weight": (config["vocab_size"], hidden),
    }
    for i in range(config["num_hidden_layers"]):
        layer = f"model.layers.{i}."
        shapes.update(
            {
                layer + "input_layernorm.weight": (hidden,),
                layer + "post_attention_layernorm.weight": (hidden,),
                layer + "self_attn.q_proj.weight": (q_out, hidden),
                layer + "self_attn.k_proj.weight": (kv_out, hidden),
                layer + "self_attn.v_proj.weight": (kv_out, hidden),
                layer + "self_attn.o_proj.weight": (hidden, q_out),
                layer + "mlp.gate_proj.weight": (inter, hidden),
                layer + "mlp.up_proj.weight": (inter, hidden),
                layer + "mlp.down_proj.weight": (hidden, inter),
            }
        )
    generator = torch.Generator().manual_seed(0)
    tensors = {}
    for name in sorted(shapes):
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(shapes[name], dtype=torch.bfloat16)
            continue
        std = next(v for k, v in WEIGHT_STD.items() if k in name)
        tensors[name] = (torch.randn(shapes[name], generator=generator) * std).to(torch.bfloat16)
    save_file(tensors, os.path.join(directory, "model.safetensors"))
    return directory


def kv_transfer_config(socket_path, **extra):
    return {
        "kv_connector": "KvwardenConnector",
        "kv_connector_module_path": "kvwarden.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"kvwarden_socket": socket_path, **extra},
    }


def make_llm(
    model_dir,
    socket_path=None,
    lora=False,
    kv_events_endpoint=None,
    kv_events_replay=None,
    **extra,
):
    from vllm import LLM

    kwargs = {}
    if kv_events_endpoint is not None:
        from vllm.config import KVEventsConfig

        kwargs["kv_events_config"] = KVEventsConfig(
            enable_kv_cache_events=True,
            publisher="zmq",
            endpoint=kv_events_endpoint,
            replay_endpoint=kv_events_replay,
        )
    if socket_path:
        kwargs["kv_transfer_config"] = kv_transfer_config(socket_path, **extra)
    if lora:
        kwargs.update(enable_lora=True, max_loras=2, max_lora_rank=8)
    llm = LLM(
        model=model_dir,
        skip_tokenizer_init=True,
        block_size=BLOCK_SIZE,
        max_model_len=4096,
        enforce_eager=True,
        dtype="bfloat16",
        seed=0,
        # The second run of a prompt must come from kvwarden, not vLLM's own cache.
        enable_prefix_caching=False,
        # On CPU vLLM would otherwise reserve most of the host's memory for KV blocks.
        kv_cache_memory_bytes=256 << 20,
        disable_log_stats=True,
        **kwargs,
    )
    return llm


def connectors(llm):
    """(scheduler-side, worker-side) connectors of an in-process engine."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    scheduler = llm.llm_engine.engine_core.engine_core.scheduler.connector
    worker = get_kv_transfer_group() if has_kv_transfer_group() else None
    return scheduler, worker


def generate(llm, prompts, max_tokens, cache_salt=None, lora=None):
    """Greedy tokens of each prompt; ``max_tokens`` one count or one per prompt;
    ``lora``: ``[name, id, path]`` of an adapter for every prompt."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    counts = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
    params = [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False)
        for n in counts
    ]
    inputs = []
    for p in prompts:
        prompt = TokensPrompt(prompt_token_ids=p)
        if cache_salt is not None:
            prompt["cache_salt"] = cache_salt
        inputs.append(prompt)
    kwargs = {}
    if lora is not None:
        from vllm.lora.request import LoRARequest

        kwargs["lora_request"] = LoRARequest(lora[0], lora[1], lora[2])
    outputs = llm.generate(inputs, params, use_tqdm=False, **kwargs)
    return [list(o.outputs[0].token_ids) for o in outputs]


class StepLog:
    """Per scheduler step: which requests ran and which waited for a kvwarden load
    (``WAITING_FOR_REMOTE_KVS``), by vLLM's request ids. With
    ``release`` set, SIGCONTs that pid once ``release_after`` steps have run while a
    load waited (the load was held by a SIGSTOPped server)."""

    def __init__(self, scheduler):
        from vllm.v1.request import RequestStatus

        self.waiting_status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.steps = []
        self.release = None
        self.release_after = 0
        original = scheduler.schedule

        def schedule(*args, **kwargs):
            out = original(*args, **kwargs)
            waiting = sorted(
                r.request_id for r in scheduler.requests.values() if r.status == self.waiting_status
            )
            ran = sorted(out.num_scheduled_tokens)
            self.steps.append({"ran": ran, "waiting_for_load": waiting})
            overlapped = sum(1 for s in self.steps if s["waiting_for_load"] and s["ran"])
            if self.release is not None and overlapped >= self.release_after:
                os.kill(self.release, signal.SIGCONT)
                self.release = None
            return out

        scheduler.schedule = schedule


def counters(scheduler, worker):
    """The connectors' counters, scheduler and worker side summed."""
    total = {}
    for connector in (scheduler, worker):
        for name, value in (connector.stats if connector else {}).items():
            total[name] = total.get(name, 0) + value
    return total


def main():
    model_dir = sys.argv[1]
    socket_path = sys.argv[2] if len(sys.argv) > 2 else None
    extra = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    out = sys.stdout
    sys.stdout = sys.stderr  # vLLM's prints must not mix with the result lines
    lora = bool(extra.pop("lora", False))
    events = extra.pop("kv_events_endpoint", None)
    replay = extra.pop("kv_events_replay", None)
    llm = make_llm(
        model_dir,
        socket_path,
        lora=lora,
        kv_events_endpoint=events,
        kv_events_replay=replay,
        **extra,
    )
    scheduler, worker = connectors(llm)
    core_scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    step_log = StepLog(core_scheduler)
    ready = {"pid": os.getpid()}
    if worker is not None:
        ready["instance_id"] = worker._worker.instance_id if worker._worker else None
        ready["root"] = scheduler._root.hex()
        load = worker.start_load_kv
        kill_at_load = []
        stop_at_load = []

        def start_load_kv(*args, **kwargs):
            # A deterministic "server killed (or stalled) mid-run": right when a step
            # starts loading.
            if worker._get_connector_metadata().loads:
                while kill_at_load:
                    os.kill(kill_at_load.pop(), signal.SIGKILL)
                while stop_at_load:
                    os.kill(stop_at_load.pop(), signal.SIGSTOP)
            return load(*args, **kwargs)

        worker.start_load_kv = start_load_kv
    out.write("KVW-READY " + json.dumps(ready) + "\n")
    out.flush()
    for line in sys.stdin:
        command = json.loads(line)
        if "kill_at_first_load" in command:
            kill_at_load.append(command["kill_at_first_load"])
        if "stall_at_first_load" in command:
            # SIGSTOP the server as the load starts, SIGCONT it after n overlapped steps.
            pid, steps = command["stall_at_first_load"]
            stop_at_load.append(pid)
            step_log.release, step_log.release_after = pid, steps
        before = counters(scheduler, worker)
        first_step = len(step_log.steps)
        tokens = generate(
            llm,
            command["prompts"],
            command.get("max_tokens", 8),
            cache_salt=command.get("cache_salt"),
            lora=command.get("lora"),
        )
        if worker is not None:
            # Saves are asynchronous: let them land, so that counts and the next
            # generate's hits do not depend on timing.
            assert worker.wait_for_lanes(60.0), "the connector's lanes did not go idle"
        after = counters(scheduler, worker)
        result = {"tokens": tokens, **{k: v - before.get(k, 0) for k, v in after.items()}}
        result["steps"] = step_log.steps[first_step:]
        if worker is not None:
            result["healthy"] = bool(worker._worker and worker._worker.is_healthy())
        out.write("KVW-RESULT " + json.dumps(result) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
