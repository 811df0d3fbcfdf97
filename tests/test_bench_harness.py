"""`python -m bench`: argument parsing, and each subcommand's smallest real run on the bundled
model (CPU), writing its JSON and PNG into a temporary folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.__main__ import build_parser, main
from mlxd import DEFAULT_MODEL_DIR

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

CODE = '''import os


def walk(root):
    """Every file under root."""
    for base, _, names in os.walk(root):
        for name in names:
            yield os.path.join(base, name)


def sizes(root):
    return {p: os.path.getsize(p) for p in walk(root)}
'''
FUNC = "".join(f"def step_{i}(x):\n    y = x + {i}\n    return y * 2\n" for i in range(4))


def _png(path: Path) -> None:
    assert path.read_bytes()[:8] == PNG_MAGIC, f"{path} is not a PNG"


def _result(path: Path, kind: str) -> dict:
    result = json.loads(path.read_text())
    assert result["bench"] == kind
    assert result["command"].startswith("python -m bench ")
    return result


@pytest.fixture(scope="module")
def dev_jsonl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small dev set in the shared file's format: code files and chat turns."""
    rows = [{"kind": "code", "text": CODE * 6}]
    answer = f"```python\n{FUNC}```"
    rows.append({"kind": "chat", "messages": [
        {"role": "user", "content": "Write four Python functions `step_i(x)`."},
        {"role": "assistant", "content": answer}]})
    path = tmp_path_factory.mktemp("data") / "dev.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# -- parsing ------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv", [
    ["sweep"], ["load", "--url", "http://127.0.0.1:1"], ["spec"], ["kv", "memory"],
    ["kv", "quality"], ["constrained"], ["trellis", "speed"], ["trellis", "sweep"],
    ["trellis", "quality"], ["plot", "x.json"], ["random-model", "out"],
])
def test_every_subcommand_parses_with_defaults(argv: list[str]):
    args = build_parser().parse_args(argv)
    assert callable(args.func)


def test_parser_values_and_errors(capsys: pytest.CaptureFixture[str]):
    p = build_parser()
    args = p.parse_args(["sweep", "--concurrency", "1,8", "--peers", "", "--out", "d"])
    assert args.concurrency == [1, 8] and args.peers == "" and args.out == Path("d")
    args = p.parse_args(["trellis", "speed", "--shapes", "64x256", "128X512"])
    assert args.shapes == [(64, 256), (128, 512)]
    for bad in (["nope"], ["kv"], ["trellis", "fast"], []):
        with pytest.raises(SystemExit) as exc:
            p.parse_args(bad)
        assert exc.value.code == 2
    capsys.readouterr()


def test_usage_names_how_it_is_started():
    assert build_parser().format_usage().startswith("usage: python -m bench ")


def test_default_results_folder_is_the_ignored_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from bench.common import out_dir

    monkeypatch.chdir(tmp_path)
    args = build_parser().parse_args(["kv", "memory"])
    out = out_dir(args, "kv-memory")
    assert out.is_dir() and out.parent == Path(".bench") and out.name.startswith("kv-memory-")
    repo = Path(__file__).resolve().parent.parent
    assert "/.bench/" in (repo / ".gitignore").read_text().splitlines()


def test_plot_refuses_an_unknown_result(tmp_path: Path):
    path = tmp_path / "x.json"
    path.write_text(json.dumps({"bench": "nothing"}))
    with pytest.raises(SystemExit, match="not a result"):
        main(["plot", str(path)])


# -- the smallest run of each subcommand --------------------------------------------------------
def test_sweep_toy_against_mlxd_then_plot(tmp_path: Path):
    out = tmp_path / "sweep"
    rc = main(["sweep", "--peers", "", "--concurrency", "1,2", "--requests-per-level", "2",
               "--prompt-tokens", "16", "--output-tokens", "6", "--out", str(out)])
    assert rc == 0
    result = _result(out / "sweep.json", "sweep")
    assert [lvl["concurrency"] for lvl in result["levels"]] == [1, 2]
    for lvl in result["levels"]:
        s = lvl["results"]["mlxd"]
        assert s["num_completed"] == 2 and s["num_failed"] == 0
        assert s["output_tokens"] == 12  # ignore_eos: exactly 6 tokens per request
        assert s["prompt_tokens_per_request"] == {"min": 16, "max": 16}
        assert s["ttft_s"]["p50"] > 0 and s["output_tok_per_cpu_s"] > 0
    _png(out / "sweep.png")
    assert "| 1 | mlxd |" in (out / "table.md").read_text()
    records = json.loads((out / "records.json").read_text())
    assert set(records) == {"mlxd@1", "mlxd@2"}
    redrawn = tmp_path / "again.png"
    assert main(["plot", str(out / "sweep.json"), "--png", str(redrawn)]) == 0
    _png(redrawn)


def test_load_against_a_running_server(real_server, tmp_path: Path):
    out = tmp_path / "load"
    assert main(["load", "--url", real_server.url, "--concurrency", "1,2", "--requests-per-level",
                 "2", "--prompt-tokens", "16", "--output-tokens", "4", "--out", str(out)]) == 0
    result = _result(out / "load.json", "load")
    assert [lvl["concurrency"] for lvl in result["levels"]] == [1, 2]
    assert all(lvl["num_completed"] == 2 and lvl["output_tokens"] == 8 for lvl in result["levels"])


def test_spec_loads_the_draft_model_only_for_modes_it_runs():
    """An edits-only run (`--workloads ""`) needs no draft model for the default `--modes`."""
    from argparse import Namespace

    from bench.spec import _uses_draft

    edits = dict(workloads="", concurrency="1,4", modes="plain,draft,ngram",
                 edit_modes="plain,ngram", edit_concurrency="1")
    assert not _uses_draft(Namespace(**edits))
    assert _uses_draft(Namespace(**{**edits, "workloads": "chat"}))
    assert not _uses_draft(Namespace(**{**edits, "workloads": "chat", "concurrency": ""}))
    assert _uses_draft(Namespace(**{**edits, "edit_modes": "plain,draft"}))
    assert not _uses_draft(Namespace(**{**edits, "edit_modes": "plain,draft", "edit_concurrency": ""}))


def test_spec_runs_every_engine_on_one_thread(monkeypatch):
    """`bench spec`'s engines are built and run one after another on one host thread (what MLX
    builds per thread on a GPU is then built once per process, as in a server), each stopping
    cleanly for the next."""
    import threading

    from bench import spec
    from engine.core import Engine
    from tests.tiny_models import loaded, tiny_model

    model, cfg = tiny_model("llama")
    lm = loaded(model, cfg)
    threads: list[tuple[int, int]] = []  # (building thread, loop thread) per engine
    init, loop = Engine.__init__, Engine._loop

    def record_init(self, *args, **kwargs):
        self._built_on = threading.get_ident()
        init(self, *args, **kwargs)

    def record_loop(self):
        threads.append((self._built_on, threading.get_ident()))
        loop(self)

    monkeypatch.setattr(Engine, "__init__", record_init)
    monkeypatch.setattr(Engine, "_loop", record_loop)
    prompts = [spec.Prompt([1, 2, 3, 4, 5], 6), spec.Prompt([7, 8, 9], 4)]
    outs = [spec.run_workload(lm, None, prompts, 2, 0.0) for _ in range(3)]
    assert [o["tokens"] for o in outs] == [10, 10, 10]
    assert len(threads) == 3 and len({t for pair in threads for t in pair}) == 1
    assert threads[0][0] != threading.get_ident()


def test_spec_warm_up_builds_the_verify_widths_of_every_mode(monkeypatch):
    """The warm-up runs each mode once, then every forced draft length up to each method's
    ceiling; a prediction's verify widths are built through n-gram, which drafts on prompts
    that carry no prediction."""
    from argparse import Namespace

    from bench import spec

    runs: list[tuple[str, int] | None] = []

    def record(lm, cfg, prompts, concurrency, temperature):
        runs.append(None if cfg is None else (cfg.method, cfg.num_draft_tokens if not cfg.adaptive else 0))
        return {"wall_s": 1.0}

    monkeypatch.setattr(spec, "run_workload", record)
    args = Namespace(num_draft_tokens=3, ngram_draft_tokens=None, temperature=0.0)
    prompts = [spec.Prompt([1, 2, 3], 4)]
    assert spec.warm_up(None, None, args, prompts, 1, ["plain", "prediction"]) == 1.0
    assert runs == [None, ("prediction", 0), ("ngram", 1), ("ngram", 2), ("ngram", 3), None]


def test_spec_toy_plain_against_ngram(tmp_path: Path, dev_jsonl: Path):
    out = tmp_path / "spec"
    rc = main(["spec", "--data", str(dev_jsonl), "--workloads", "code", "--concurrency", "1",
               "--requests-per-stream",
               "2", "--max-tokens", "10", "--modes", "plain,ngram-k", "--edit-modes",
               "plain,ngram-k,prediction", "--edit-concurrency", "1", "--edit-requests", "1",
               "--dtype", "float32", "--out", str(out), "--trace-steps", str(tmp_path / "trace")])
    assert rc == 0
    result = _result(out / "spec.json", "spec")
    # one step trace per timed run, each with the run's rounds
    traces = {p.name: [json.loads(x) for x in p.read_text().splitlines()]
              for p in (tmp_path / "trace").iterdir()}
    assert sorted(traces) == ["code-c1-ngram-k-0.jsonl", "code-c1-plain-0.jsonl",
                              "edit-c1-ngram-k-0.jsonl", "edit-c1-plain-0.jsonl",
                              "edit-c1-prediction-0.jsonl"]
    assert not any(s["width"] > 1 for s in traces["code-c1-plain-0.jsonl"])
    assert result["config"]["draft"] is None  # no draft mode asked: no draft model loaded
    assert [(g["workload"], g["concurrency"]) for g in result["results"]] == [("code", 1),
                                                                              ("edit", 1)]
    for group in result["results"]:
        plain, ngram = group["modes"]["plain"], group["modes"]["ngram-k"]
        assert ngram["tokens"] == plain["tokens"] > 0  # greedy: speculation emits the same
        assert ngram["ratio_vs_plain"] > 0 and plain["ratio_vs_plain"] == 1.0
        assert "spec" in ngram and "spec" not in plain
        assert "outputs" not in plain  # the replay's input stays out of the JSON
        replay = ngram["lookup_replay"]  # greedy, one row: the lookup replayed
        # every token but the prefill's first, per request
        assert replay["tokens"] == plain["tokens"] - group["num_requests"]
        assert replay["plain_steps"] + replay["rounds"] <= replay["tokens"]
    edit_ngram = result["results"][1]["modes"]["ngram-k"]["spec"]
    assert sum(s["width"] > 1 for s in traces["edit-c1-ngram-k-0.jsonl"]) == edit_ngram["spec_steps"]
    predicted = result["results"][1]["modes"]["prediction"]  # the edit's renamed function
    assert predicted["tokens"] == result["results"][1]["modes"]["plain"]["tokens"]
    assert predicted["spec"]["method"] == "prediction" and predicted["spec"]["drafted_tokens"] > 0
    _png(out / "spec.png")


def test_spec_toy_json_rows_speculate_under_their_schema(tmp_path: Path, dev_jsonl: Path):
    """The json workload's rows are held to the record schema and still speculate: n-gram
    copies the record asked for, with the same tokens as plain decoding."""
    out = tmp_path / "spec"
    rc = main(["spec", "--data", str(dev_jsonl), "--workloads", "json", "--concurrency", "1",
               "--requests-per-stream", "2", "--max-tokens", "60", "--modes", "plain,ngram-k",
               "--edit-concurrency", "", "--dtype", "float32", "--out", str(out)])
    assert rc == 0
    (group,) = _result(out / "spec.json", "spec")["results"]
    plain, ngram = group["modes"]["plain"], group["modes"]["ngram-k"]
    assert group["workload"] == "json" and ngram["tokens"] == plain["tokens"] > 0
    assert ngram["spec"]["accepted_tokens"] > 0


def test_lookup_replay_counts_a_copied_stretch():
    """The replay on a hand-made request: the row's second token is its join step's (plain);
    then the suffix `6 7 8` is found in the prompt and its 4 continuations are all accepted (5
    tokens for one verify of width 5); `13` was never seen, so the last step is plain. With a
    plain step of 10 ms and a width-5 verify of 15 ms, 7 tokens cost 35 ms instead of 70."""
    from bench.spec import Prompt, lookup_replay

    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 5, 6]
    out = [7, 8, 9, 10, 11, 12, 13, 14]
    replay = lookup_replay([Prompt(prompt, 64)], [out], 4, {"1x1": 10.0, "1x5": 15.0, "4x1": 99.0})
    assert replay == {"tokens": 7, "plain_steps": 2, "rounds": 1, "acceptance_rate": 1.0,
                      "tokens_per_round": 5.0, "mean_verify_width": 5.0,
                      "decode_bound_ratio": 2.0}
    # a ceiling of 2: 9 10 (+11), then 12 5 of which 12 is accepted (+13), then plain; two
    # verifies of width 3 at the interpolated 12.5 ms
    two = lookup_replay([Prompt(prompt, 64)], [out], 2, {"1x1": 10.0, "1x5": 15.0})
    assert (two["rounds"], two["plain_steps"], two["tokens_per_round"]) == (2, 2, 2.5)
    assert two["acceptance_rate"] == 0.75
    assert two["decode_bound_ratio"] == round(70 / (2 * 10 + 2 * 12.5), 3)


def test_spec_run_reports_a_failed_request_instead_of_waiting(monkeypatch):
    """An engine step that fails ends its requests with an error: the bench raises it on its
    own thread at once (the engine's thread goes on), rather than waiting for them for ever."""
    from bench import spec as bench_spec
    from engine.loader import load_model
    from engine.runner import Runner

    def broken(self, plan):
        raise RuntimeError("planted step failure")

    monkeypatch.setattr(Runner, "run", broken)
    lm = load_model(str(DEFAULT_MODEL_DIR), dtype="float32")
    with pytest.raises(RuntimeError, match="a request failed"):
        bench_spec.run_workload(lm, None, [bench_spec.Prompt([1, 2, 3], 4), bench_spec.Prompt([4, 5, 6], 4)], 1, 0.0)


def test_kv_memory_toy(tmp_path: Path):
    out = tmp_path / "kv"
    assert main(["kv", "memory", "--seq", "96", "--chunk", "32", "--repeats", "1",
                 "--out", str(out)]) == 0
    report = _result(out / "kv_memory.json", "kv-memory")
    for rows in report["footprints"].values():
        ratio = {r["kv"]: r["rows_vs_16bit"] for r in rows}
        assert ratio["16"] == 1.0 and 1.0 < ratio["8/g64"] < ratio["4/g64"]
    assert report["prefix_cache"]["cached_tokens"] > 0
    _png(out / "kv_memory.png")


def test_kv_quality_toy(tmp_path: Path, dev_jsonl: Path):
    out = tmp_path / "kvq"
    assert main(["kv", "quality", "--data", str(dev_jsonl), "--windows", "1", "--window", "80",
                 "--chunk", "40", "--bits", "8", "--group-size", "64", "--out", str(out)]) == 0
    report = _result(out / "kv_quality.json", "kv-quality")
    assert report["results"]["16"]["mean_kl_nats"] == 0.0
    assert 0.0 < report["results"]["8/g64"]["mean_kl_nats"] < 0.05
    _png(out / "kv_quality.png")


def test_constrained_toy(tmp_path: Path):
    from engine import constrain
    from engine.constrain import llg

    before = (constrain.fill_masks, llg.LLGConstraint.consume)
    out = tmp_path / "con"
    assert main(["constrained", "--tokens", "4", "--repeats", "1", "--out", str(out)]) == 0
    assert (constrain.fill_masks, llg.LLGConstraint.consume) == before  # timing undone
    result = _result(out / "constrained.json", "constrained")
    summary = result["summary_median"]
    assert summary["b1_free"]["grammar_ms_per_step"] == 0.0
    assert summary["b16_constrained"]["grammar_ms_per_step"] > 0.0
    assert set(result["ratios_paired_median"]) == {
        "b1_constrained_over_free_per_token", "b16_constrained_over_free_per_token",
        "b16_half_over_free_throughput", "b16_tools_over_free_throughput"}
    _png(out / "constrained.png")


@pytest.fixture
def twin_kernel(monkeypatch: pytest.MonkeyPatch):
    """The fused trellis kernel replaced by its plain-MLX twin, so that the GPU modes run here."""
    import mlx.core as mx

    from kernels.trellis import matvec
    from kernels.trellis.quantizer import TrellisWeight

    real = matvec.matmul_rotated

    def twin(x, packed, scales, *, bits, L, block, code="1mad", backend=None, config=None,
             out_dtype=None):
        w = TrellisWeight(packed, scales, mx.ones((x.shape[-1],), mx.int8), bits, L, block, code)
        return real(x, w, use_fused=False).astype(out_dtype or x.dtype)

    monkeypatch.setattr(matvec, "trellis_matvec", twin)
    monkeypatch.setattr(matvec, "fused_backend", lambda: "cuda")
    monkeypatch.setattr(matvec, "kernel_variant", lambda backend: "twin")
    monkeypatch.setattr(matvec, "matmul_rotated", lambda x, w, use_fused=None: real(x, w, use_fused=False))


def test_trellis_speed_toy(tmp_path: Path, twin_kernel):
    out = tmp_path / "ts"
    assert main(["trellis", "speed", "--shapes", "64x256", "--batches", "1", "--skip-encoder",
                 "--working-set-mib", "1", "--out", str(out)]) == 0
    result = _result(out / "trellis_speed.json", "trellis-speed")
    variants = {r["variant"] for r in result["matvec"]}
    assert {"bf16 matmul", "affine 4-bit g64 quantized_matmul", "trellis 3-bit"} <= variants
    assert all(r["us_per_call"] > 0 for r in result["matvec"])
    _png(out / "trellis_speed.png")


def test_trellis_sweep_toy(tmp_path: Path, twin_kernel):
    out = tmp_path / "tsw"
    tuned = tmp_path / "tuned.json"
    assert main(["trellis", "sweep", "--shapes", "128x512", "--working-set-mib", "0.05",
                 "--calls", "2", "--tuned", str(tuned), "--out", str(out)]) == 0
    result = _result(out / "trellis_sweep.json", "trellis-sweep")
    assert not result["errors"], result["errors"]
    checked = [r for r in result["rows"] if r["config"] != "affine-q4-quantized_matmul"]
    assert checked and all(r["ok"] and r["max_err_rel"] < 2e-2 for r in checked)
    assert set(json.loads(tuned.read_text())) == {"128x512x1", "128x512x4"}
    _png(out / "trellis_sweep.png")


@pytest.mark.parametrize("kernel", [False, True], ids=["masked-only", "kernel-twin"])
def test_attention_toy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kernel: bool):
    """Off CUDA only the masked route is timed; with the kernel (its plain-MLX twin standing
    in) both are, and the kernel's difference from the masked result is recorded."""
    if kernel:
        from kernels import common as kcommon
        from kernels.attention import decode

        monkeypatch.setattr(kcommon, "gpu_backend", lambda: "cuda")
        monkeypatch.setattr(decode, "decode_attention",
                            lambda q, k, v, lens, scale: decode.twin(q, k, v, lens, scale))
    out = tmp_path / "attn"
    assert main(["attention", "--heads", "4x2x64", "--rows", "1,3", "--contexts", "64,300",
                 "--layers", "2", "--repeats", "1", "--out", str(out)]) == 0
    result = _result(out / "attention.json", "attention")
    assert result["kernel"] is kernel and len(result["rows"]) == 4
    for r in result["rows"]:
        assert r["masked_ms"] > 0 and r["context"] // 2 * r["rows"] <= r["keys"]
        assert ("kernel_ms" in r) is kernel
        if kernel:
            assert r["max_abs_err"] == 0.0 and r["speedup"] > 0
    _png(out / "attention.png")


def test_random_model(tmp_path: Path):
    from engine.loader import load_model

    out = tmp_path / "tiny"
    assert main(["random-model", str(out), "--shape", "tiny", "--bits", "0"]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["hidden_size"] == 256 and cfg["num_hidden_layers"] == 4
    lm = load_model(str(out), dtype="float32")
    assert lm.vocab_size == 8192 and len(lm.model.layers) == 4


def test_random_model_large_vocabulary(tmp_path: Path):
    """--vocab pads the tokenizer: the text's ids stay the bundled ones, every id decodes."""
    from transformers import AutoTokenizer

    out = tmp_path / "wide-vocab"
    assert main(["random-model", str(out), "--shape", "tiny", "--bits", "0",
                 "--vocab", "9000"]) == 0
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 9000
    tok = AutoTokenizer.from_pretrained(str(out))
    bundled = AutoTokenizer.from_pretrained(str(DEFAULT_MODEL_DIR))
    assert len(tok) == 9000
    text = "def add(a, b):\n    return a + b\n"
    assert tok.encode(text) == bundled.encode(text)
    assert tok.decode([8191 + 1, 8999]) == "<x8192><x8999>"


def test_trellis_quality_toy(tmp_path: Path):
    """On a random model of the tiny shape (the pipeline, not the quality: a random model's
    perplexity says nothing), with four distinct records: calibration and evaluation apart."""
    from bench.modelprep import random_model

    model = random_model("tiny", tmp_path / "tiny", bits=None)
    data = tmp_path / "dev.jsonl"
    texts = ["".join(f"def f{i}_{j}(x):\n    return x * {i * 100 + j}\n" for j in range(12))
             for i in range(4)]
    data.write_text("".join(json.dumps({"kind": "code", "text": t}) + "\n" for t in texts))
    out = tmp_path / "tq"
    assert main(["trellis", "quality", "--model", str(model), "--data", str(data), "--bits", "2",
                 "--L", "8", "--modes", "plain", "--finetune-steps", "0", "--windows", "1",
                 "--length", "32", "--calib-windows", "2", "--calib-length", "32",
                 "--block-tune-steps", "0", "--out", str(out)]) == 0
    result = _result(out / "trellis_quality.json", "trellis-quality")
    rows = {r["name"]: r for r in result["variants"]}
    assert set(rows) == {"bf16", "affine 4-bit g64", "affine 3-bit g64", "trellis 2-bit L=8 plain"}
    assert rows["affine 4-bit g64"]["bits_per_weight"] == 4.5
    assert 2.0 < rows["trellis 2-bit L=8 plain"]["bits_per_weight"] < 2.2
    assert all(r["perplexity"] > 1.0 for r in rows.values())
    _png(out / "trellis_quality.png")


def test_coldstart_toy(tmp_path: Path):
    """The cold-start bench against mlxd alone: every phase answered, its JSON and PNG written."""
    from bench.coldstart import PHASES, burst_lengths

    assert burst_lengths(64, 3) == [16, 40, 64]
    out = tmp_path / "cs"
    assert main(["coldstart", "--prompt-tokens", "64", "--burst", "2", "--output-tokens", "4",
                 "--mlxd-args=--no-warmup", "--out", str(out)]) == 0
    result = _result(out / "coldstart.json", "coldstart")
    entry = result["servers"]["mlxd"]
    assert entry["startup_s"] > 0
    for phase in PHASES:
        recs = entry["phases"][phase]["requests"]
        assert len(recs) == (2 if "burst" in phase else 1)
        assert all(r["ok"] and r["ttft_s"] > 0 for r in recs)
    assert [r["prompt_tokens"] for r in entry["phases"]["warm_burst"]["requests"]] == [16, 64]
    _png(out / "coldstart.png")


def test_embed_toy(tmp_path: Path):
    """The embeddings bench on the bundled model: every batch answered, its JSON and PNG."""
    out = tmp_path / "embed"
    assert main(["embed", "--batches", "1,4", "--tokens", "16", "--repeats", "2",
                 "--mlxd-args=--no-warmup", "--out", str(out)]) == 0
    result = _result(out / "embed.json", "embed")
    for b in ("1", "4"):
        entry = result["batches"][b]
        assert len(entry["seconds"]) == 2 and entry["best_s"] == min(entry["seconds"])
        assert entry["prompt_tokens"] == 16 * int(b)
        assert entry["inputs_per_s"] == pytest.approx(int(b) / entry["best_s"])
    _png(out / "embed.png")
