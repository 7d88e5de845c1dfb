"""The model families' layout rules, on the import graph (`test_layout`'s): the engines reach a family only through
the family protocols and their registries, families never import each other's subpackage, and the policies written
once for every family read an engine through its public methods only."""

from __future__ import annotations

import ast

from test_layout import PKG, _graph, _violations

# What is one family's own code (a second family never imports it; the engines never import it).
FAMILY_CODE = {
    "cosyvoice2": ("token2wav.cv2", "config.cv2", "model_dir.official_cv2", "models.speech_lm", "models.flow",
                   "models.hift"),
    "cosyvoice3": ("token2wav.cv3", "config.cv3", "model_dir.official_cv3", "models.cv3", "frontend.prompt_cv3"),
}
# The engines: the LLM engine's core, the runtime's loop and jobs, and what token2wav writes once for every family.
ENGINES = ("engine", "runtime.async_engine", "runtime.handle", "token2wav.protocol", "token2wav.budget",
           "token2wav.voice_cache", "token2wav.config")
# Where the engines meet the families: the registries (and the protocol types the engines are typed with).
REGISTRIES = ("engine.lm_family", "engine.vllm", "token2wav", "frontend.family", "model_dir", "config")


def _under(module: str, roots: tuple[str, ...]) -> bool:
    return any(module == f"vocalis.{r}" or module.startswith(f"vocalis.{r}.") for r in roots)


def test_engines_reach_families_only_through_the_protocols() -> None:
    """`engine/`, the runtime loop and token2wav's shared modules import no family's own modules: they hold a
    family's objects through `LMFamily` / `SpeechLMShape` and `Token2Wav` / `Token2WavStream`, made by the
    registries (`engine.lm_family`, `vocalis.token2wav`, `frontend.family`, `model_dir`)."""
    graph = _graph()
    family = tuple(root for roots in FAMILY_CODE.values() for root in roots)
    engines = {m: deps for m, deps in graph.items() if _under(m, ENGINES) and not _under(m, REGISTRIES[:2])
               and m != "vocalis.token2wav"}
    bad = _violations(engines, ENGINES, family)
    assert not bad, "engine modules importing a family's own code:\n" + "\n".join(bad)


def test_families_do_not_import_each_other() -> None:
    """A family's token2wav, config, loader and frontend import none of another family's (the model maths in
    `models/` is shared: CosyVoice 3's modules build on CosyVoice 2's)."""
    graph = _graph()
    bad: list[str] = []
    for name, roots in FAMILY_CODE.items():
        own = tuple(r for r in roots if not r.startswith("models."))
        others = tuple(r for other, rs in FAMILY_CODE.items() if other != name for r in rs
                       if not r.startswith("models."))
        bad += _violations(graph, own, others)
    assert not bad, "a family's subpackage importing another family's:\n" + "\n".join(bad)


def test_a_family_is_one_registry_entry() -> None:
    """The factories live in the package faces and registries, not in a family's module: the only modules that
    import both families' code are the registries (and the reference path and benches, which run both)."""
    graph = _graph()
    both = []
    for module, deps in graph.items():
        hits = [name for name, roots in FAMILY_CODE.items() if any(_under(d, roots) for d in deps)]
        if len(hits) == 2 and not _under(module, REGISTRIES + ("reference", "bench", "train", "backends")):
            both.append(module)
    # a family's own modules may reuse the other's maths (CosyVoice 3's modules build on CosyVoice 2's)
    both = [m for m in both if not any(_under(m, roots) for roots in FAMILY_CODE.values())]
    assert not both, "modules choosing between families outside the registries:\n" + "\n".join(sorted(both))


def test_shared_policies_use_public_engine_methods() -> None:
    """The cache budget and the voice-prefix cache, written once, touch no private attribute of another object
    (an engine's `_live`, `_voices`, `_next_call`...): only `self`'s own."""
    bad = []
    for name in ("budget.py", "voice_cache.py", "protocol.py"):
        tree = ast.parse((PKG / "token2wav" / name).read_text())
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and not (isinstance(node.value, ast.Name) and node.value.id == "self")):
                bad.append(f"token2wav/{name}:{node.lineno}: {ast.unparse(node)}")
    assert not bad, "private attributes read across objects:\n" + "\n".join(bad)
