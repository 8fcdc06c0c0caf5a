"""The finder: built-ins, dotted paths in both forms, entry points of an installed
distribution, and the errors for a typo, a missing module and a missing attribute."""

from __future__ import annotations

import sys
import textwrap

import pytest

from posttrain.finder import (
    ImportFailed,
    Kind,
    NotFound,
    did_you_mean,
    find,
    import_object,
    load,
    nearest,
    target_of,
)

GROUP = "posttrain.finder_test_widgets"
MODULE = """
class Gear:
    teeth = 12

    class Inner:
        pass


def make_cog():
    return "cog"
"""


@pytest.fixture
def widgets(tmp_path, monkeypatch):
    """`finder_widgets` on sys.path, installed as pip installs a distribution: a dist-info
    directory whose entry_points.txt puts `cog` in the test's entry-point group."""
    (tmp_path / "finder_widgets.py").write_text(textwrap.dedent(MODULE))
    dist = tmp_path / "finder_widgets-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: finder-widgets\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[{GROUP}]\ncog = finder_widgets:make_cog\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield Kind("widget", {"gear": "the gear", "spring": "the spring"}, GROUP, "mypkg.w:make")
    sys.modules.pop("finder_widgets", None)


def test_a_builtin_is_its_table_entry(widgets):
    found = find("gear", widgets)
    assert (found.source, found.target, found.what) == ("builtin", "gear", "widget")
    assert found.load() == "the gear" and load("spring", widgets) == "the spring"


def test_a_dotted_path_names_a_module_attribute_or_a_nested_one(widgets):
    found = find("finder_widgets:Gear", widgets)
    assert (found.source, found.target) == ("path", "finder_widgets:Gear")
    assert "finder_widgets" not in sys.modules  # finding imports nothing
    gear = found.load()
    module = sys.modules["finder_widgets"]
    assert gear is module.Gear
    assert load("finder_widgets:Gear.Inner", widgets) is module.Gear.Inner
    assert load("finder_widgets:Gear.teeth", widgets) == 12
    assert target_of(module.Gear.Inner) == "finder_widgets:Gear.Inner"
    assert target_of(module.Gear()) == "finder_widgets:Gear"  # an instance: its class


def test_an_entry_point_of_an_installed_distribution(widgets):
    found = find("cog", widgets)
    assert (found.source, found.target) == ("entry_point", "finder_widgets:make_cog")
    assert found.what == f"widget 'cog' (entry point in {GROUP})"
    assert found.load() is sys.modules["finder_widgets"].make_cog
    assert widgets.known() == ["gear", "spring", "cog"]  # built-ins first, then installed


def test_a_typo_gets_the_nearest_name_and_every_way_to_add_one(widgets):
    with pytest.raises(NotFound) as caught:
        find("gera", widgets)
    assert str(caught.value) == (
        "unknown widget 'gera'; did you mean 'gear'? (known widgets: gear, spring, cog; name "
        "one of your own by its dotted path, e.g. 'mypkg.w:make', or install it under the "
        f"'{GROUP}' entry-point group)"
    )
    # Another way to add one goes between the dotted path and the entry-point group.
    losses = Kind("loss", {}, GROUP, "mypkg.l:f", plural="losses", also="register it")
    with pytest.raises(NotFound, match=r"known losses: cog; .*'mypkg.l:f', register it, or "):
        find("cgo", losses)
    # A name nothing is close to gets no suggestion; a kind without a group names one way.
    bare = Kind("gadget", {}, plural="gadgetry", example="mypkg.g:make")
    with pytest.raises(NotFound) as caught:
        find("zzz", bare)
    assert str(caught.value) == (
        "unknown gadget 'zzz' (known gadgetry: none; name one of your own by its dotted path, "
        "e.g. 'mypkg.g:make')"
    )


def test_a_missing_module_says_which_and_why(widgets, tmp_path):
    with pytest.raises(ImportFailed) as caught:
        load("no_such_module_xyz.sub:thing", widgets)
    assert str(caught.value) == (
        "widget 'no_such_module_xyz.sub:thing': module 'no_such_module_xyz.sub' does not "
        "import: ModuleNotFoundError: No module named 'no_such_module_xyz'"
    )
    # Both a ValueError (a bad name) and an ImportError (a failed import), as callers expect.
    assert isinstance(caught.value, ValueError) and isinstance(caught.value, ImportError)
    with pytest.raises(ImportFailed, match=rf"\(looked in sys.path and {tmp_path}\)$"):
        import_object("no_such_module_xyz:thing", "reward", search=tmp_path)


def test_a_missing_attribute_names_its_owner_and_the_nearest(widgets):
    with pytest.raises(ImportFailed) as caught:
        load("finder_widgets:Gaer", widgets)
    assert str(caught.value) == (
        "widget 'finder_widgets:Gaer': 'finder_widgets' has no attribute 'Gaer'; did you mean "
        "'Gear'?"
    )
    with pytest.raises(ImportFailed) as caught:
        load("finder_widgets:Gear.Iner", widgets)
    assert str(caught.value) == (
        "widget 'finder_widgets:Gear.Iner': 'finder_widgets.Gear' has no attribute 'Iner'; "
        "did you mean 'Inner'?"
    )


@pytest.mark.parametrize("spec", ["my widgets:x", "pkg:", ":Name", "pkg:a-b"])
def test_a_malformed_dotted_path_says_how_to_write_one(widgets, spec):
    with pytest.raises(NotFound) as caught:
        find(spec, widgets)
    assert str(caught.value) == (
        f"widget {spec!r} is not a dotted path; write it as 'package.module:name'"
    )


def test_the_suggestion_helper():
    # difflib's ratio 2M/T (M matched characters, T both lengths): "locl" vs "local" matches
    # "loc" and "l", 2*4/9 = 0.89 >= 0.6; it shares no character with "ray" or "tinker": 0.
    assert nearest("locl", ["ray", "local", "tinker"]) == "local"
    assert did_you_mean("locl", ["ray", "local", "tinker"]) == "; did you mean 'local'?"
    # "xyz" vs "ray": one common character, 2*1/6 = 0.33 < 0.6: no suggestion.
    assert nearest("xyz", ["ray"]) is None and did_you_mean("xyz", ["ray"]) == ""
