"""The docs fold: no prose sentence is stated twice between the README and docs/*.md."""

from __future__ import annotations

import difflib
import itertools
import pathlib
import re

ROOT = pathlib.Path(__file__).parents[2]
DOCS = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]


def prose_sentences(text: str) -> list[str]:
    """Sentences of 20+ characters outside code blocks, whitespace and case folded."""
    prose = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
    out = []
    for paragraph in re.split(r"\n\s*\n", prose):
        paragraph = " ".join(paragraph.split())
        for sentence in re.split(r"(?<=[.!?:;])\s+(?=[A-Z`(*\-|])", paragraph):
            if len(sentence) >= 20:
                out.append(sentence.lower())
    return out


def repeated(files: dict[str, str], threshold: float = 0.85) -> list[tuple[str, str, str]]:
    found = []
    sentences = {name: prose_sentences(text) for name, text in files.items()}
    # real_quick_ratio is 2 min(len) / (len + len): below the threshold whenever the
    # shorter sentence is under `shortest` of the longer one. One matcher per `other`
    # (SequenceMatcher caches what it learns of its second sequence).
    shortest = threshold / (2 - threshold)
    for a, b in itertools.combinations(sentences, 2):
        for other in sentences[b]:
            matcher = difflib.SequenceMatcher(None, "", other)
            for one in sentences[a]:
                if min(len(one), len(other)) < shortest * max(len(one), len(other)):
                    continue
                matcher.set_seq1(one)
                if (matcher.real_quick_ratio() > threshold and matcher.quick_ratio() > threshold
                        and matcher.ratio() > threshold):
                    found.append((a, b, one))
    return found


def test_no_sentence_twice_between_readme_and_docs():
    files = {name: (ROOT / name).read_text() for name in DOCS}
    assert repeated(files) == []


def test_the_check_finds_a_repeated_sentence():
    sentence = "The pass keeps every sharding annotation of the lowered module."
    files = {"a.md": f"Intro.\n\n{sentence}\n", "b.md": f"Other words here.\n\n{sentence}\n"}
    assert repeated(files) == [("a.md", "b.md", sentence.lower())]


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but - and _ dropped."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_relative_links_and_anchors_resolve():
    """Every relative link of the README and docs/*.md names a file that exists, and a
    #fragment names a heading of that file."""
    broken = []
    for name in DOCS:
        page = ROOT / name
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:
            path, _, fragment = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists():
                broken.append(f"{name}: {target}")
            elif fragment and linked.suffix == ".md":
                headings = re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", linked.read_text(),
                                                           flags=re.DOTALL), re.MULTILINE)
                if fragment not in {_anchor(h) for h in headings}:
                    broken.append(f"{name}: {target}")
    assert not broken, broken


def _design_citations(text: str) -> tuple[set[str], set[str], set[str]]:
    """(paths, dotted hlo_amp names, backticked identifiers) docs/design.md cites."""
    paths = set(re.findall(r"(?<![\w/.])((?:hlo_amp|tests|benchmarks|docs|examples|passes|runtime"
                           r"|numerics)/[\w/.*]*[\w/])", text))
    paths |= set(re.findall(r"`([\w/]+\.(?:py|mlir|md))`", text))
    paths |= {f"docs/{name}" for name in re.findall(r"(?<![\w/])(\w+\.md)\b", text)
              if name != "DOT_LAYOUT.md"}
    spans = re.findall(r"`([^`\n]+)`", text)
    dotted = {span for span in spans if re.fullmatch(r"hlo_amp(\.\w+)+", span)}
    names = set()
    for span in spans:
        span = re.sub(r"\(.*", "", span)  # run(module, report) names run
        if (re.fullmatch(r"[A-Za-z_]\w*(\.\w+)?", span)
                and not re.search(r"\.(py|mlir|md)$", span)
                and not span.startswith(("jax.", "nnx.", "eqx.", "core.", "ad.", "batching.",
                                         "mlir.", "stages.", "Exported."))):
            names.add(span)
    return paths, dotted, names


def _exists(path: str) -> bool:
    """A cited path: from the root, under hlo_amp/ (passes/..., runtime/...), or a bare
    file name found in the package, the tests or the benchmarks."""
    if any(next(ROOT.glob(str(pathlib.Path(prefix, path))), None)
           for prefix in ("", "hlo_amp")):  # a glob (tests/lit/jax_*.mlir) matches a file
        return True
    return "/" not in path and any(
        next((ROOT / top).rglob(path), None) for top in ("hlo_amp", "tests", "benchmarks"))


def test_design_doc_cites_only_paths_and_names_that_exist():
    """docs/design.md is the map a newcomer follows: every file and folder it cites
    exists, every ``hlo_amp.x.y`` it names is a module or a name defined there, every
    ``Class.member`` is defined, and every other backticked identifier occurs in the
    package's source or the lit files (a renamed or removed function fails here)."""
    text = (ROOT / "docs" / "design.md").read_text()
    paths, dotted, names = _design_citations(text)
    missing = sorted(path for path in paths if not _exists(path))
    assert paths and not missing, missing
    files = [p for p in (ROOT / "hlo_amp").rglob("*.py") if "__pycache__" not in p.parts]
    source = "\n".join(p.read_text() for p in files)
    defined_re = re.compile(r"^\s*(?:def (\w+)|class (\w+)|(\w+)(?:: [^=\n]+)? = )",
                            re.MULTILINE)
    defined = {name for found in defined_re.findall(source) for name in found if name}
    for name in dotted:  # hlo_amp.numerics, hlo_amp.rewrite, hlo_amp.compile
        parts = name.split(".")
        module = ROOT.joinpath(*parts)
        assert (module.is_dir() or module.with_suffix(".py").exists()
                or parts[-1] in defined), name
    unknown = []
    words = set(re.findall(r"\w+", source))
    lit = "\n".join(p.read_text() for p in (ROOT / "tests" / "lit").glob("*.*")
                    if p.suffix in (".mlir", ".py"))
    for name in names:
        owner, _, member = name.rpartition(".")
        if owner[:1].isupper() and owner not in {"HLO_AMP_VERIFY_EACH"}:
            if not (owner in defined and member in defined):
                unknown.append(name)
        elif not set(name.split(".")) <= words and name not in lit:
            unknown.append(name)
    assert not unknown, unknown
    must = {"default_pipeline", "pass_names", "lowering_target", "platforms_target",
            "matrix_result_in_16bit", "low_result", "mark_kept_by_xla",
            "device_target", "compile_for_target", "amp_call_p", "refuse_policy_on_device",
            "run_pipeline", "site_of", "swap_module", "rewrite_lowered", "xla_gemms"}
    assert all(name in text for name in must)
    assert must <= defined
    # The team's notes outside the repository are cited nowhere (the names are split so
    # that a grep of the repository for them finds nothing, this test included).
    outside = ("shared/" + "DESIGN", "DESIGN" + ".md")
    for name in DOCS:
        assert not any(word in (ROOT / name).read_text() for word in outside), name
