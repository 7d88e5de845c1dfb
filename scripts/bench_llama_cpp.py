"""The CosyVoice 2 LLM decode on llama.cpp (llama-cpp-python) against Vocalis's engine, same weights (issue 22).

    VENV/bin/python scripts/bench_llama_cpp.py [--rounds 3] [--threads 2] [--vocalis-python .venv/bin/python]

VENV has llama-cpp-python and gguf, which are not project dependencies. The Vocalis side runs in a worker
process under the project's venv (this file with --worker), so neither venv needs the other's packages.

The worker builds `random_model("cosyvoice2-0.5b")` and hands its LLM weights over; this side writes them as
GGUF (qwen2 architecture; the speech head, 6561+3 rows, is the output head and the speech table the token table;
F32, F16 and Q8_0) and drives llama.cpp through the low-level API with input embeddings (llama_batch.embd) and
logits for every decode row — the only way RAS sampling and text-in-pieces keep working. Ours is timed by the
helpers behind `vocalis bench --parts llm` (`_engine_llm`: RAS requests, every stop id masked); llama.cpp with
the same prompts (~150 positions per sequence), the same step counts, arg-max over the logits picking the next
speech embedding. The sides alternate within each round: on a shared machine the ratios within a round hold.
Pause other work while timing: with 2 threads on 2 cores, a competing process (even a niced one) costs llama.cpp
far more than its CPU share (its threads meet at a barrier after every op; Q8_0 batch 1 fell from 27 to 2.4 tok/s
beside the niced trainer here), and ours less, so a loaded round understates llama.cpp.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

PROMPT_SPEECH = 105  # voice prompt speech ids: with sos, task id and the texts ~150 prompt positions per sequence
BATCH = 16
CHECK_STEPS = 16  # teacher-forced decode steps in the logits check
CTX_PER_SEQ = 256  # KV positions per sequence: prompt + 1 + warm-up + timed steps fit
GGUF_TYPES = ("f32", "f16", "q8_0")
SIDES = (("ours", "fp32"), ("llama.cpp", "f32"), ("ours", "int8"), ("llama.cpp", "q8_0"), ("llama.cpp", "f16"))


# ---- the Vocalis side (project venv) -------------------------------------------------------------------------
def worker(threads: int, work: Path) -> None:
    """Line protocol on stdin/stdout: `export` or `measure <precision>` -> one JSON line."""
    results = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever else prints (torch, extension builds) goes to stderr, not into the protocol
    from vocalis.bench.decode_bytes import llm_bytes_per_token
    from vocalis.bench.engine_side import _engine_llm
    from vocalis.bench.scenario import BenchConfig, bench_text, bench_voice, build

    cfg = BenchConfig(threads=threads, batches=(1, BATCH), prompt_tokens=PROMPT_SPEECH, parts=("llm",))
    models = {p: build(cfg, p) for p in ("fp32", "int8")}  # same seed: the same weights, int8 quantized in place
    voice = bench_voice(models["fp32"][0], cfg)
    for line in sys.stdin:
        cmd = line.split()
        if cmd[0] == "export":
            reply = _export(models, voice, cfg, bench_text, work)
        else:
            model, rt, runtime = models[cmd[1]]
            out = _engine_llm(cfg, model, rt, voice, cmd[1], llm_bytes_per_token(model.config.llm, cmd[1]))
            reply = {"runtime": runtime, "prefill_tps": out["llm"][str(BATCH)]["prefill_tps"],
                     "tps": {b: out["llm"][b]["decode_tps"] for b in out["llm"]},
                     "read_gbps": out["decode_b1"]["read_gbps_spread"]["median"]}
        print(json.dumps(reply), file=results, flush=True)


def _export(models, voice, cfg, bench_text, work: Path) -> dict:
    """Weights (fp32, torch layout), the B prompts' embeddings, and the teacher-forced check: its inputs and the
    fp32 and int8 (our quantized Linears, per-op forward) speech logits at the last prompt position and after."""
    import torch

    fp32, int8 = models["fp32"][0], models["int8"][0]
    lm, tok = fp32.llm, fp32.tokenizer
    with torch.no_grad():
        weights = {k: v.float().numpy() for k, v in lm.state_dict().items() if "embed_tokens" not in k}
        np.savez(work / "weights.npz", **weights)
        prompts = [lm.prefill_embeddings(tok.encode(bench_text(cfg, i)), voice.prompt_text_ids,
                                         voice.prompt_speech_ids)[0].numpy() for i in range(BATCH)]  # (L_i, D)
        ids = torch.randint(0, lm.config.speech_token_size, (CHECK_STEPS,), generator=torch.Generator().manual_seed(3))
        inputs = torch.cat((torch.from_numpy(prompts[0])[None], lm.embed_speech(ids)), dim=1)  # (1, L+S, D)
        last = prompts[0].shape[0] - 1
        ref = {p: m.llm(inputs)[0, last:].numpy() for p, m in (("fp32", fp32), ("int8", int8))}  # (S+1, V)
    np.savez(work / "inputs.npz", check_inputs=inputs[0].numpy(), check_fp32=ref["fp32"], check_int8=ref["int8"],
             **{f"prompt{i}": p for i, p in enumerate(prompts)})
    q = lm.config.qwen  # the shapes for the GGUF header (this side has no torch to import vocalis with)
    shapes = {k: getattr(q, k) for k in ("max_position_embeddings", "hidden_size", "num_hidden_layers",
                                         "intermediate_size", "num_attention_heads", "num_key_value_heads",
                                         "rope_theta", "rms_norm_eps")}
    return {"prompt_lens": [p.shape[0] for p in prompts], "shapes": shapes, "vocab": lm.config.num_speech_rows}


# ---- GGUF -------------------------------------------------------------------------------------------------------
def write_gguf(path: Path, weights: dict, shapes: dict, vocab: int, qtype: str) -> None:
    """`weights`: our LLM state dict (numpy); `shapes`: QwenConfig fields; `vocab`: speech head rows."""
    import gguf

    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_context_length(shapes["max_position_embeddings"])
    w.add_embedding_length(shapes["hidden_size"])
    w.add_block_count(shapes["num_hidden_layers"])
    w.add_feed_forward_length(shapes["intermediate_size"])
    w.add_head_count(shapes["num_attention_heads"])
    w.add_head_count_kv(shapes["num_key_value_heads"])
    w.add_rope_freq_base(shapes["rope_theta"])  # qwen2 = NEOX rotary: our half-split layout, no q/k permutation
    w.add_layer_norm_rms_eps(shapes["rms_norm_eps"])
    w.add_tokenizer_model("no_vocab")  # llama.cpp's "no vocabulary" type: dummy tokens, counted by vocab_size
    w.add_vocab_size(vocab)
    kind = {"f32": gguf.GGMLQuantizationType.F32, "f16": gguf.GGMLQuantizationType.F16,
            "q8_0": gguf.GGMLQuantizationType.Q8_0}[qtype]
    w.add_file_type({"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                     "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[qtype])
    names = {"speech_embedding.weight": "token_embd.weight", "llm_decoder.weight": "output.weight",
             "llm_decoder.bias": "output.bias", "llm.model.model.norm.weight": "output_norm.weight"}
    per_layer = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
                 "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                 "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for i in range(shapes["num_hidden_layers"]):
        for ours, theirs in per_layer.items():
            for part in ("weight", "bias"):
                names[f"llm.model.model.layers.{i}.{ours}.{part}"] = f"blk.{i}.{theirs}.{part}"
    for ours, theirs in names.items():
        if ours not in weights:
            continue  # o_proj and the MLP have no bias
        t = np.ascontiguousarray(weights[ours], dtype=np.float32)  # (out, in): GGUF reverses to ggml's {in, out}
        if t.ndim == 1 or kind == gguf.GGMLQuantizationType.F32:  # norms and biases stay F32, as converters do
            w.add_tensor(theirs, t)
        elif kind == gguf.GGMLQuantizationType.F16:
            w.add_tensor(theirs, t.astype(np.float16))
        else:
            w.add_tensor(theirs, gguf.quants.quantize(t, kind), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# ---- the llama.cpp side -------------------------------------------------------------------------------------
class LlamaLM:
    """One model and context; `decode` feeds embedding rows (pos, seq id, wants logits) and returns the logits
    of the rows that asked, in order: (n_wanted, V)."""

    def __init__(self, path: Path, threads: int, n_seq: int) -> None:
        import llama_cpp as L

        self.L = L
        self.model = L.llama_model_load_from_file(str(path).encode(), L.llama_model_default_params())
        if not self.model:
            raise SystemExit(f"llama.cpp could not load {path}")
        p = L.llama_context_default_params()
        p.n_ctx, p.n_seq_max, p.kv_unified = n_seq * CTX_PER_SEQ, n_seq, True  # one KV pool, sequences by id
        p.n_batch, p.n_threads, p.n_threads_batch = p.n_ctx, threads, threads
        self.ctx = L.llama_init_from_model(self.model, p)
        self.n_embd = L.llama_model_n_embd(self.model)
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.batch = b = L.llama_batch_init(p.n_batch, self.n_embd, 1)
        view = np.ctypeslib.as_array  # numpy views of the batch's arrays: filled without a Python loop
        self.embd, self.pos = view(b.embd, shape=(p.n_batch, self.n_embd)), view(b.pos, shape=(p.n_batch,))
        self.n_seq_id, self.want = view(b.n_seq_id, shape=(p.n_batch,)), view(b.logits, shape=(p.n_batch,))
        self.kv_type = "f16 K/V" if p.type_k == 1 else f"K/V type {p.type_k}"

    def clear(self) -> None:
        self.L.llama_memory_clear(self.L.llama_get_memory(self.ctx), True)

    def decode(self, embd: np.ndarray, pos: np.ndarray, seq: np.ndarray, want: np.ndarray) -> np.ndarray:
        b, n = self.batch, len(pos)
        b.n_tokens = n
        self.embd[:n], self.pos[:n], self.n_seq_id[:n], self.want[:n] = embd, pos, 1, want
        for i in range(n):
            b.seq_id[i][0] = int(seq[i])
        if (rc := self.L.llama_decode(self.ctx, b)) != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        return np.ctypeslib.as_array(self.L.llama_get_logits(self.ctx), shape=(int(want.sum()), self.n_vocab)).copy()

    def prefill(self, prompts: list[np.ndarray]) -> np.ndarray:
        """Sequences 0..len-1 in one llama_decode (llama.cpp splits it into micro-batches); last-row logits."""
        self.clear()
        lens = [len(p) for p in prompts]
        pos = np.concatenate([np.arange(n) for n in lens])
        seq = np.repeat(np.arange(len(prompts)), lens)
        want = np.zeros(len(pos), np.int8)
        want[np.cumsum(lens) - 1] = 1
        return self.decode(np.concatenate(prompts), pos, seq, want)


def llama_run(lm: LlamaLM, prompts: list[np.ndarray], table: np.ndarray, warmup: int, steps: int) -> tuple:
    """Prefill the prompts as sequences, decode `warmup` untimed then `steps` timed steps, one row per sequence
    per step: returns (prefill positions/s, decode tok/s over all rows)."""
    n_rows, stops = len(prompts), table.shape[0] - 3
    start = time.perf_counter()
    logits = lm.prefill(prompts)
    prefill_tps = sum(len(p) for p in prompts) / (time.perf_counter() - start)
    pos = np.array([len(p) for p in prompts])
    seq, want = np.arange(n_rows), np.ones(n_rows, np.int8)
    for i in range(warmup + steps):
        if i == warmup:
            start = time.perf_counter()
        ids = logits[:, :stops].argmax(-1)  # stand-in for RAS over the row's logits, stop ids masked
        logits = lm.decode(table[ids], pos, seq, want)
        pos += 1
    return prefill_tps, n_rows * steps / (time.perf_counter() - start)


def logits_check(lm: LlamaLM, data, prompts: list[np.ndarray]) -> np.ndarray:
    """The check sequence as sequence 0, teacher-forced, while sequences 1..3 (other prompts) decode in the same
    batches: its logits must equal the single-sequence fp32 reference (so sequences stay apart as well)."""
    inputs, n0 = data["check_inputs"], len(prompts[0])
    others = prompts[1:4]
    rows = [lm.prefill([inputs[:n0], *others])[0]]
    pos = np.array([n0] + [len(p) for p in others])
    seq, want = np.arange(len(pos)), np.ones(len(pos), np.int8)
    for t in range(CHECK_STEPS):
        embd = np.concatenate([inputs[n0 + t][None], prompts[0][-len(others):]])  # the others: any embeddings
        rows.append(lm.decode(embd, pos, seq, want)[0])
        pos += 1
    return np.stack(rows)  # (S+1, V)


def compare(got: np.ndarray, ref: np.ndarray) -> str:
    err = np.abs(got - ref).max()
    rel = np.sqrt(((got - ref) ** 2).mean() / ref.var())  # error rms over the logits' spread
    agree = int((got.argmax(-1) == ref.argmax(-1)).sum())
    return f"max abs {err:.2e} (logits up to {np.abs(ref).max():.1f}), rms/std {rel:.1e}, argmax {agree}/{len(ref)}"


# ---- main ---------------------------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--vocalis-python", default=str(Path(__file__).resolve().parents[1] / ".venv/bin/python"))
    ap.add_argument("--work-dir", default="/tmp/vocalis-llamacpp", help="weights, inputs and GGUF files go here")
    ap.add_argument("--out", help="write every figure as JSON here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    if args.worker:
        return worker(args.threads, work)
    try:
        import gguf  # noqa: F401
        import llama_cpp
    except ImportError as e:
        raise SystemExit(f"{e.name} is not installed in {sys.executable}: run this with a venv that has "
                         "llama-cpp-python and gguf (pip install llama-cpp-python gguf; not a Vocalis dependency)")
    quiet = llama_cpp.llama_log_callback(lambda *_: None)  # kept referenced: llama.cpp calls it until exit
    llama_cpp.llama_log_set(quiet, ctypes.c_void_p())

    proc = subprocess.Popen([args.vocalis_python, __file__, "--worker", "--threads", str(args.threads),
                             "--work-dir", str(work)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ask(cmd: str) -> dict:
        proc.stdin.write(cmd + "\n")
        proc.stdin.flush()
        if not (line := proc.stdout.readline()):
            raise SystemExit(f"the Vocalis worker ended (exit {proc.wait()}); its error is above")
        return json.loads(line)

    exported = ask("export")
    prompt_lens = exported["prompt_lens"]
    weights, data = dict(np.load(work / "weights.npz")), np.load(work / "inputs.npz")
    prompts = [data[f"prompt{i}"] for i in range(BATCH)]
    table = weights["speech_embedding.weight"]
    models = {}
    for qtype in GGUF_TYPES:
        path = work / f"cosyvoice2-llm-{qtype}.gguf"
        start = time.perf_counter()
        write_gguf(path, weights, exported["shapes"], exported["vocab"], qtype)
        models[qtype] = LlamaLM(path, args.threads, BATCH)
        print(f"{qtype}: {path.stat().st_size / 2**20:.0f} MiB, written and loaded in "
              f"{time.perf_counter() - start:.1f} s", flush=True)
    del weights
    print(f"prompt positions per sequence: {min(prompt_lens)}-{max(prompt_lens)}; llama.cpp "
          f"{llama_cpp.__version__}, {models['f32'].kv_type}, {llama_cpp.llama_print_system_info().decode()}")

    print("\nlogits against our fp32 forward, same weights, last prompt position + "
          f"{CHECK_STEPS} teacher-forced steps (llama.cpp: sequence 0 of 4 decoded together)")
    print(f"  ours int8 (same quantized Linears, per-op): {compare(data['check_int8'], data['check_fp32'])}")
    for qtype, lm in models.items():
        print(f"  llama.cpp {qtype}: {compare(logits_check(lm, data, prompts), data['check_fp32'])}", flush=True)

    warmup, steps = 4, 64  # as _engine_llm: 4 untimed, 64 timed at batch 1; 16 timed at batch 16
    rounds: list[dict] = []
    for r in range(args.rounds):
        row = {}
        for side, prec in SIDES:
            if side == "ours":
                got = ask(f"measure {prec}")
                if r == 0:
                    print(f"ours {prec}: {got['runtime']}")
                row[f"ours {prec}"] = {"1": got["tps"]["1"], "16": got["tps"]["16"],
                                       "prefill16": got["prefill_tps"], "read_gbps": got["read_gbps"]}
            else:
                _, b1 = llama_run(models[prec], prompts[:1], table, warmup, steps)
                pf, b16 = llama_run(models[prec], prompts, table, 0, 16)
                row[f"llama.cpp {prec}"] = {"1": b1, "16": b16, "prefill16": pf}
            print(f"round {r + 1} {side} {prec}: " + ", ".join(f"{k} {v:.1f}" for k, v in row[f'{side} {prec}'].items()),
                  flush=True)
        rounds.append(row)
    proc.stdin.close()
    proc.wait()

    print("\n| side | batch 1 tok/s (best) | per round | batch 16 aggregate tok/s (best) | per round "
          "| prefill, 16 seqs, pos/s (best) |\n|---|---|---|---|---|---|")
    for name in rounds[0]:
        cells = []
        for key in ("1", "16"):
            vals = [rd[name][key] for rd in rounds]
            cells += [f"{max(vals):.1f}", ", ".join(f"{v:.1f}" for v in vals)]
        print(f"| {name} | " + " | ".join(cells) + f" | {max(rd[name]['prefill16'] for rd in rounds):.0f} |")
    print("\nratios within each round (llama.cpp / ours): " + "; ".join(
        f"round {i + 1}: " + ", ".join(f"{a}/{o} b1 {rd[f'llama.cpp {a}']['1'] / rd[f'ours {o}']['1']:.2f} "
                                       f"b16 {rd[f'llama.cpp {a}']['16'] / rd[f'ours {o}']['16']:.2f}"
                                       for a, o in (("f32", "fp32"), ("q8_0", "int8")))
        for i, rd in enumerate(rounds)))
    if args.out:
        Path(args.out).write_text(json.dumps({"prompt_lens": prompt_lens, "rounds": rounds}, indent=1))


if __name__ == "__main__":
    main()
