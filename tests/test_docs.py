"""The docs' checkable claims stay true: wire volumes, numbers quoted from docs/results, cited tests, the license.

Conventions the docs follow (and this file enforces):
- a table of measured numbers is a block rendered by ``docs/gen_results.py`` from its stored result, never a hand copy;
  a sentence that cites ``docs/results/<file>`` quotes only numbers in that file, as rounded;
- every ``docs/results/<file>`` and ``tests/<file>.py[::test]`` a doc names exists;
- the docs stand alone: no machine paths, no references to notes outside the repository.
"""

import importlib.util
import json
import math
import re
from pathlib import Path

import pytest

from birder_hf.collectives import expected_bytes

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "recipes" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RESULTS = ROOT / "docs" / "results"
README = (ROOT / "README.md").read_text(encoding="utf-8")

NUMBER = re.compile(r"(?<![\w.])-?\d[\d,]*(?:\.\d+)?(?:e-?\d+)?(?![\w.])")


def _text(path):
    return path.read_text(encoding="utf-8")


def _table_after(text, marker):
    """Rows (lists of cells) of the markdown table that follows ``marker``, header and separator excluded."""
    lines = text[text.index(marker) :].splitlines()[1:]
    rows = []
    for line in lines:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows[2:]


# --------------------------------------------------------------------------------------- wire volume


def _bits(method, layout, inter_method="allgather"):
    """Bits per parameter per step one rank sends, total and between nodes."""
    d = 2**22  # a multiple of every method's alignment for these layouts: no padding
    b = expected_bytes("allgather" if method == "fp32" else method, d, layout, inter_method=inter_method)
    if method == "fp32":
        return 8 * b["fp32_allreduce_bytes"] / d, None
    return 8 * (b["intra_node_bytes"] + b["inter_node_bytes"]) / d, 8 * b["inter_node_bytes"] / d


def test_wire_volume_table_is_what_expected_bytes_computes():
    rows = _table_after(_text(ROOT / "docs" / "ALGORITHM.md"), "<!-- wire-volume table")
    methods = {"fp32 DDP (baseline)": "fp32", "`allgather`": "allgather", "`scatter_gather`": "scatter_gather"}
    seen = set()
    for cells in rows:
        method = methods.get(cells[0], "hierarchical" if cells[0].startswith("`hierarchical`") else None)
        assert method is not None, cells
        seen.add(method)
        for layout, (total, inter) in zip([(2, 2), (4, 8)], [cells[2:4], cells[4:6]]):
            want_total, want_inter = _bits(method, layout)
            assert float(total) == want_total, (method, layout)
            assert (inter == "") if want_inter is None else (float(inter) == want_inter), (method, layout)
    assert seen == {"fp32", "allgather", "scatter_gather", "hierarchical"}


def test_readme_headline_volume_and_main_job_output_are_the_stored_run():
    total, inter = _bits("hierarchical", (2, 2))
    fp32, _ = _bits("fp32", (2, 2))
    flat = " ".join(README.split())
    assert f"2 nodes × 2 ranks, {total:g} bits per parameter ({inter:g} of them between nodes)" in flat
    assert f"sends {fp32:g}, {fp32 / total:g}× less" in flat
    # the two lines README quotes are the stored reference run's, and its counters give the same volume
    stored = _text(RESULTS / "readme_main_job.txt")
    quoted = re.findall(r"`(EM [^`]+|bytes sent per rank:[^`]+)`", README.replace("\n", " "))
    quoted = [q for q in quoted if "{" not in q]  # not the code
    assert len(quoted) == 2
    for line in quoted:
        assert line in stored.replace("\n", " "), line
    res = json.loads(_text(RESULTS / "readme_main_job.json"))
    sent = res["comm/intra_node_bytes"] + res["comm/inter_node_bytes"]
    assert f"EM {res['eval_exact_match']:.1f}  F1 {res['eval_f1']:.1f}" in quoted[0]
    assert f"{sent / 1e6:.2f} MB (inter-node {res['comm/inter_node_bytes'] / 1e6:.2f} MB)" in quoted[1]
    assert res["comm/fp32_allreduce_bytes"] / sent == pytest.approx(fp32 / total, rel=1e-4)  # padding aside
    assert res["comm/inter_node_bytes"] / sent == pytest.approx(inter / total, rel=1e-4)


# ----------------------------------------------------------------------------- stored results, citations


def _numbers_in(path):
    text = _text(path)
    if path.suffix != ".json":
        return [float(x.replace(",", "")) for x in NUMBER.findall(text)]
    out = []

    def walk(v):
        if isinstance(v, bool):
            return
        if isinstance(v, (int, float)):
            out.append(float(v))
        elif isinstance(v, dict):
            for k, x in v.items():
                try:  # a number used as a key (a grid's learning rates) is one of the file's numbers too
                    out.append(float(k))
                except ValueError:
                    pass
                walk(x)
        elif isinstance(v, list):
            for x in v:
                walk(x)
        elif isinstance(v, str):  # a recipe flag's value, stored as the command line had it ("0.4", "1e-3")
            try:
                out.append(float(v))
            except ValueError:
                pass

    walk(json.loads(text))
    return out


def _quoted(token, values):
    """``token`` as written (e.g. "6.87", "150,000,000", "1e-3") is one of ``values`` rounded to its digits."""
    x = float(token.replace(",", ""))
    decimals = len(token.split(".")[1]) if "." in token and "e" not in token else 0
    tol = 0.5 * 10**-decimals + 1e-9 if "e" not in token else 1e-12
    return any(math.isclose(v, x, abs_tol=tol) for v in values)


def test_measured_tables_are_generated_not_copied():
    # a table of measured numbers is a block docs/gen_results.py renders from its docs/results/ file; a hand copy (the
    # `<!-- numbers: -->` marker of before issue 40) could drift from the file, and a block outside gen_results.DOCS
    # would never be checked
    gen = _gen_results()
    for doc in DOCS:
        text = _text(doc)
        assert "<!-- numbers:" not in text, f"{doc.name}: a hand-copied table; render it in docs/gen_results.py"
        assert doc in gen.DOCS or not gen.BLOCK.search(text), f"{doc.name} has generated blocks; add it to DOCS"
    rendered = {doc.name for doc in gen.DOCS if gen.BLOCK.search(_text(doc))}
    assert rendered >= {"README.md", "BENCHMARKS.md", "CONVERGENCE.md", "ALGORITHM.md", "SETUPS.md", "VALIDATION.md"}


TESTS = {path.name: _text(path) for path in sorted((ROOT / "tests").glob("*.py"))}
CODE = "\n".join(_text(p) for d in ("src", "benchmarks", "recipes") for p in sorted((ROOT / d).rglob("*.py")))


def test_cited_result_files_and_tests_exist():
    for doc in DOCS:
        text = _text(doc)
        for name in re.findall(r"(?:docs/)?results/([\w.-]+\.(?:json|md|png|txt))", text):
            assert (RESULTS / name).is_file(), f"{doc.name} cites docs/results/{name}"
        for path, test in re.findall(r"(tests/[\w/]+\.py)(?:::(\w+))?", text):
            assert (ROOT / path).is_file(), f"{doc.name} cites {path}"
            if test:
                assert re.search(rf"^def {test}\(", _text(ROOT / path), re.M), f"{doc.name} cites {path}::{test}"
        # a test named without its file (`test_x`) is a test function somewhere in tests/ (or, like timm's
        # `test_resnet` model, a name the code itself uses)
        for test in re.findall(r"(?<![:\w/])`(test_\w+)`", text):
            found = any(re.search(rf"^def {test}\(", body, re.M) for body in TESTS.values())
            exists = found or f"{test}.py" in TESTS or f'"{test}"' in CODE
            assert exists, f"{doc.name} cites {test}, which does not exist"


def _slug(heading):
    """GitHub's anchor of a markdown heading: lower case, punctuation but - and _ dropped, spaces as -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_between_docs_reach_a_file_and_heading():
    for doc in DOCS:
        for target, anchor in re.findall(r"\]\(([\w./-]*\.md|)(?:#([\w-]+))?\)", _text(doc)):
            path = (doc.parent / target).resolve() if target else doc
            assert path.is_file(), f"{doc.name} links to {target}"
            if anchor:
                slugs = {_slug(h) for h in re.findall(r"^#+ (.+)$", _text(path), re.M)}
                assert anchor in slugs, f"{doc.name} links to {target}#{anchor}, a heading {path.name} does not have"


CITE = re.compile(r"(?:docs/)?results/([\w.-]+\.(?:json|md|txt))")
DECIMAL = re.compile(r"(?<![\w.])-?\d[\d,]*(?:\.\d+(?:e-?\d+)?|e-\d+)(?![\w.])")  # 6.05, 0.163, 2e-3: measured-looking


def _sentences(text):
    """Sentences of the prose (code blocks left out) and rows of the tables, each on one line."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    out = []
    for block in re.split(r"\n\s*\n", text):
        lines = block.splitlines()
        if lines and all(line.startswith("|") for line in lines):
            out += lines
            continue
        for item in re.split(r"\n(?=\s*[-*] |\s*\d+\. )", block):
            out += re.split(r"(?<=[.;:])\s+(?=[A-Z*(\[`])", " ".join(item.split()))
    return out


def test_numbers_next_to_a_cited_results_file_are_in_it():
    # a sentence (or table row) that cites docs/results/<file> quotes that file: each decimal number in it must be
    # one of the file's numbers, as rounded (whole numbers are left out: counts, sizes and settings). Sentences about
    # a previous version of a file (`git show <rev>:docs/results/...`, `git log -p ...`) cite history, not the file.
    # Generated blocks are left out whole: they are rendered from the files they cite (and read back in the tests
    # below).
    cache, wrong, block = {}, [], _gen_results().BLOCK
    for doc in DOCS:
        for sentence in _sentences(block.sub("", _text(doc))):
            files = CITE.findall(sentence)
            if not files or "<!--" in sentence or "git show" in sentence or "git log" in sentence:
                continue
            values = []
            for name in files:
                if name not in cache:
                    path = RESULTS / name
                    cache[name] = _numbers_in(path) if path.is_file() else []
                values += cache[name]
            for x in DECIMAL.findall(sentence):
                if not _quoted(x, values):
                    wrong.append(f"{doc.name}: {x} not in {files}: {sentence[:160]}")
    assert not wrong, "\n".join(wrong)


def test_docs_stand_alone():
    # no paths of the machine the docs were written on, no notes outside the repository
    bad = re.compile(r"/work/|/root/|/home/|\.\./shared|project notes|FACTS\.md|DESIGN(?:\.md| table)")
    for doc in DOCS:
        for n, line in enumerate(_text(doc).splitlines(), 1):
            assert not bad.search(line), f"{doc.relative_to(ROOT)}:{n}: {line.strip()}"


# ------------------------------------------------------------------------------------------ API reference


def test_api_reference_is_what_the_code_gives():
    # docs/API.md is generated from every public module's __all__, signatures and docstrings; a change to any of them
    # without `python docs/gen_api.py` fails here
    spec = importlib.util.spec_from_file_location("gen_api", ROOT / "docs" / "gen_api.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    want = gen.generate()
    have = _text(ROOT / "docs" / "API.md")
    drift = [line for line in want.splitlines() if line not in have.splitlines()]
    drift += [line for line in have.splitlines() if line not in want.splitlines()]
    assert have == want, "docs/API.md is not what the code gives; run python docs/gen_api.py. Differing lines:\n" + (
        "\n".join(drift[:10])
    )


# ------------------------------------------------------------------------------- blocks rendered from results


def _gen_results():
    spec = importlib.util.spec_from_file_location("gen_results", ROOT / "docs" / "gen_results.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    return gen


def test_generated_blocks_are_what_the_stored_results_give():
    # README's "Where it stands" (and any block marked the same way) is rendered from docs/results/; a new result or a
    # hand edit inside a block without `python docs/gen_results.py` fails here
    gen = _gen_results()
    blocks = 0
    for doc in gen.DOCS:
        text = _text(doc)
        blocks += len(gen.BLOCK.findall(text))
        assert gen.render(text, doc) == text, f"{doc.name}: a generated block is stale; run python docs/gen_results.py"
    assert blocks >= 1 and "<!-- generated by docs/gen_results.py: standing -->" in README


def test_generated_blocks_follow_the_results_and_refuse_unknown_names():
    gen = _gen_results()
    block = "<!-- generated by docs/gen_results.py: standing -->\nstale\n<!-- end generated -->"
    rendered = gen.render(block)
    assert "stale" not in rendered and "| QA F1" in rendered and "recipe_matrix_qa.json" in rendered
    qa = json.loads(_text(RESULTS / "recipe_matrix_qa_1x2_keep_heldout.json"))["cells"]["1x2"]["birder-beta0.8-keep"]
    assert f"{qa['median']:.1f} / {qa['worst']:.1f}" in rendered  # the numbers are the file's
    # a setting run in two batches of seeds is pooled: the median and worst of all its seeds
    finals, higher, _ = gen._pool(
        [("recipe_matrix_qa.json", "adamw"), ("recipe_matrix_qa_2x2_seeds6-7.json", "adamw")], "2x2"
    )
    assert sorted(finals) == [3, 4, 5, 6, 7, 42] and higher
    assert gen._median_worst({1: 50.0, 2: 40.0, 3: 60.0, 4: 55.0}, True) == "52.5 / 40.0"
    assert gen._median_worst({1: 150.0, 2: 140.0}, False) == "145.0 / 150.0"  # perplexity: the worst is the highest
    with pytest.raises(ValueError, match="in two sources"):
        gen._pool([("recipe_matrix_qa.json", "adamw"), ("recipe_matrix_qa.json", "adamw")], "2x2")
    with pytest.raises(KeyError, match="no config 'nonsense'"):
        gen._pool([("recipe_matrix_qa.json", "nonsense")], "2x2")
    with pytest.raises(KeyError, match="knows standing"):
        gen.render(block.replace("standing", "nonsense"))


def test_speed_blocks_are_the_stored_runs_numbers():
    # the speed tables are pivots of their JSON: a cell read back from the rendered table is the stored value
    gen = _gen_results()
    run = json.loads(_text(RESULTS / "throughput.json"))
    birder = next(s for s in run["summary"] if s["profile"] == "ethernet" and s["model"] == "bert"
                  and s["batch_per_proc"] == 8 and s["method"] == "birder-hierarchical")  # fmt: skip
    row = next(r for r in gen.throughput("ethernet").splitlines() if r.startswith("| BERT-Base (AdamW) | 8 |"))
    assert f"**{birder['ratio_vs_fp32']:.2f}×**" in row and f"{birder['share_of_bound']:.2f}" in row
    cost = json.loads(_text(RESULTS / "cost_model.json"))
    got = next(p for p in cost["predictions"] if (p["model"], p["network"], p["nodes"], p["batch"], p["method"])
               == ("bert", "10GbE", 2, 32, "birder-hierarchical"))  # fmt: skip
    assert f"| 2 | {gen._x(got['speedup'])} / " in gen.cost_model()
    codec = json.loads(_text(RESULTS / "codec.json"))
    assert f"**{codec['ratio_vs_copy']['quantize+pack']:.2f}**" in gen.codec()
    sizes = json.loads(_text(RESULTS / "codec_small.json"))["us_per_call"]
    assert f"| 1,024 | {sizes['1024']['quantize_pack eager']:.1f} |" in gen.codec_small()
    wire = json.loads(_text(RESULTS / "collectives.json"))["rows"]
    assert all(f"{r['bytes_sent_per_rank']:,}" in gen.collectives() for r in wire)


def _row(rendered, first):
    """The cells of the rendered table's row whose first cell is ``first``."""
    for line in rendered.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0] == first:
            return cells
    raise AssertionError(f"no row {first!r} in:\n{rendered}")


def test_result_blocks_are_the_stored_runs_numbers():
    # every other renderer, one cell or more read back and compared with its JSON
    gen = _gen_results()

    def load(name):
        return json.loads(_text(RESULTS / name))

    name = "simulate_quality_qa_seeds3-13_wu0.2_rounding.json"
    run, cells = load(name)["runs"]["2x2"], _row(gen.simulate_quality(name), "Birder 2 × 2")
    missed = [seed for seed, step in run["step_to_target"].items() if step is None]
    assert cells[4] == gen._seeds(map(int, missed)) and cells[6] == f"{run['median']:.1f} / {run['worst']:.1f}"
    clip = load("update_rule_ablation_lm_clipping.json")["cells"]["adam-bounded-tclip"]
    rendered = gen.update_rule_ablation("update_rule_ablation_lm_clipping.json")
    assert _row(rendered, gen.ABLATION_WORDS["adam-bounded-tclip"])[2:] == [
        f"{clip['median']:.1f}",
        f"{clip['worst']:.1f}",
    ]
    lazy = load("tta_stale.json")["tasks"]["qa@0.002"]["variants"]["lazy"]
    rows = [r for r in gen.tta_stale().splitlines() if r.startswith("| `lazy=True` | 0.002 |")]
    assert rows and " / ".join(f"{lazy['final'][str(s)]:.1f}" for s in lazy["seeds"]) in rows[0]
    adamw = load("convergence_lr_checks.json")["checks"]["bert-adamw-lr0.004"]["runs"][0]  # seed 0, at 4e-3
    rows = [r for r in gen.convergence_lr().splitlines() if r.startswith("| BERT | AdamW |")]
    assert adamw["seed"] == 0 and rows[0].endswith(f" / {adamw['final']['eval_f1']:.1f} |")
    lrs = {row.split(" (")[0]: [c.strip() for c in row.strip("|").split("|")] for row in gen.lr_choices().splitlines()}
    tuned = load("tta.json")["tuned"]["lm"]["birder-h"]  # every rate of the grid, in order, and the one chosen
    grid = sorted(tuned["grid"].items(), key=lambda kv: float(kv[0]))
    cells = lrs["| causal LM, tiny GPT-2, time to accuracy"]
    assert cells[2] == gen._lr(tuned["lr"]) and cells[3].endswith(" / ".join(f"{v:.1f}" for _, v in grid))
    hsdp = {
        r["settings"]["birder_lr"]: r["summary"]["hsdp-birder"]["final_eval_loss"]["mean"]
        for r in map(load, gen.HSDP_LR)
    }
    assert lrs["| causal LM, 1-bit HSDP"][2] == gen._lr(min(hsdp, key=hsdp.get))  # the lowest validation loss
    seconds = load("checkpoint_checksum.json")["seconds"]
    assert (
        _row(gen.checkpoint_checksum(), "completion marker, sizes and SHA-256 (now)")[1]
        == f"{seconds['mark, sizes + sha256 (now)']:g}"
    )
    before = load("zero_grad_rows.json")["runs"]["before"]
    assert _row(gen.zero_grad_rows(), "before: independent draws")[4] == f"{before['max_move_lr']:.3g}"
    fade = load("stale_drift.json")["drift_in_lr"]["ddp_hook_4_ranks_2x2_hierarchical"]["fade"]["1000"]
    assert _row(gen.stale_drift("200", "1000"), '`stale="fade"` (default)')[4] == " / ".join(f"{x:g}" for x in fade)
    tiny, base = load("elastic_restart_tiny.json"), load("elastic_restart_base.json")
    cells = _row(
        gen.elastic_restart("elastic_restart_tiny.json", "elastic_restart_base.json"), "kill → training again"
    )
    assert cells[1:] == [f"{tiny['kill_to_training_s']:g} s", f"{base['kill_to_training_s']:g} s"]
    lookup = load("agreement.json")["cache_lookup_us"]
    assert f"| {lookup:g} µs |" in gen.agreement()


def test_readme_is_short():
    assert len(README.splitlines()) <= 200, "README.md: at most 200 lines; move detail to docs/"


# ------------------------------------------------------------------------------ provenance of stored results

HASH = re.compile(r"[0-9a-f]{40}")


def test_every_stored_result_names_its_commit():
    # a stored result says which code made it: the commit its run recorded (report_commit, or commit in
    # update_rule_ablation's files; None only where the run had no git), else the last commit that stored the file
    # (stored_at_commit, written for the results stored before benchmarks recorded it: the run was at or before it)
    missing, wrong = [], []
    for path in sorted(RESULTS.glob("*.json")):
        result = json.loads(_text(path))
        if not isinstance(result, dict):
            continue
        keys = [k for k in ("report_commit", "commit", "stored_at_commit") if k in result]
        if not keys:
            missing.append(path.name)
        for key in keys:
            value = result[key]
            no_git = key == "report_commit" and value is None
            if not no_git and not (isinstance(value, str) and HASH.fullmatch(value)):
                wrong.append(f"{path.name}: {key} = {value!r}")
    assert not missing, f"results that name no commit: {missing}; see benchmarks/provenance.py"
    assert not wrong, "not a full commit hash:\n" + "\n".join(wrong)


def test_provenance_gives_the_commit_the_command_and_uncommitted_changes():
    # benchmarks/provenance.py: what every benchmark merges into the result it stores
    spec = importlib.util.spec_from_file_location("provenance_under_test", ROOT / "benchmarks" / "provenance.py")
    provenance = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(provenance)
    got = provenance.provenance(ROOT / "benchmarks" / "codec.py", ["--small", "--out", "a b.json"])
    assert set(got) == {"report_commit", "command", "dirty"}
    assert got["command"] == "python benchmarks/codec.py --small --out 'a b.json'"  # repeatable from the root
    if provenance._git("rev-parse", "HEAD") is None:  # no git, or not a repository: nothing to name
        assert got["report_commit"] is None and got["dirty"] is None
    else:
        assert HASH.fullmatch(got["report_commit"]) and isinstance(got["dirty"], bool)


# ---------------------------------------------------------------------------------------------- license


def test_license_text_ships_in_the_distribution():
    tomllib = pytest.importorskip("tomllib")
    text = _text(ROOT / "LICENSE")
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text
    meta = tomllib.loads(_text(ROOT / "pyproject.toml"))
    project = meta["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    # PEP 639 license expressions and license-files need hatchling 1.27
    assert any(re.fullmatch(r"hatchling>=1\.(2[7-9]|[3-9]\d)(\.\d+)?", r) for r in meta["build-system"]["requires"])
    assert "@inproceedings{birder2023" in README  # the citation stays in the README
