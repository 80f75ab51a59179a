"""Where an installed SGLang's version sits among the supported releases (``versions.place``): post releases,
driven with their base release's row; a source checkout newer than the newest release, driven as main with
its rows; the refusal of anything else. Without SGLang installed: versions are given, or faked by a
``sglang`` distribution written into a temporary directory on ``sys.path``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from refcache.check.bisect import choose_releases, system_for
from refcache.check.known import ReleaseRange
from refcache.config import PROFILES
from refcache.engines.sglang import _compat as compat
from refcache.engines.sglang import versions
from refcache.errors import UnsupportedError, UsageError
from refcache.systems import SYSTEMS, engine_placements

NEWEST = versions.RELEASES[-1].version


def test_a_post_release_is_ordered_after_its_base_and_before_the_next_release() -> None:
    order = ["0.5.11", "0.5.10.post2", "0.5.10", "0.5.9", "0.5.10.post1"]
    assert sorted(order, key=versions.parse) == ["0.5.9", "0.5.10", "0.5.10.post1", "0.5.10.post2", "0.5.11"]
    assert list(versions.POST_RELEASES) == sorted(versions.POST_RELEASES, key=versions.parse)
    for bad in ("0.5.10rc1", "0.5.10.post", "0.5.24.dev3", "0.5.10+gabc", "0.5", "main"):
        with pytest.raises(UsageError, match="is not a release number"):
            versions.parse(bad)


def test_a_range_written_in_releases_holds_their_post_releases() -> None:
    """A row or decision whose bound is a release applies to its post releases (they are driven with its
    row); a bound written as a post release is compared exactly."""
    assert "0.5.10.post1" in versions.Until("0.5.10") and "0.5.10.post1" in versions.Since("0.5.10")
    assert "0.5.10.post1" in versions.Releases("0.5.10", "0.5.10")
    assert "0.5.10.post1" not in versions.Since("0.5.11") and "0.5.11.post1" not in versions.Until("0.5.10")
    assert "0.5.10" not in versions.Since("0.5.10.post1") and "0.5.10.post1" in versions.Since("0.5.10.post1")
    assert "0.5.10.post2" not in versions.Until("0.5.10.post1") and "0.5.10" in versions.Until("0.5.10.post1")
    # the known findings' ranges read a release end the same way
    assert "0.5.10.post1" in ReleaseRange.parse("0.5.5..0.5.10") and "0.5.10.post1" in ReleaseRange.parse(
        "0.5.10"
    )
    assert "0.5.4.post3" not in ReleaseRange.parse("0.5.5..0.5.10")
    assert "0.5.11" not in ReleaseRange.parse("0.5.5..0.5.10")
    assert "0.5.10.post2" not in ReleaseRange.parse("..0.5.10.post1")
    assert "0.5.10" not in ReleaseRange.parse("0.5.10.post1..")


def test_a_range_before_a_post_release_holds_its_base_but_not_its_post_releases() -> None:
    """``Before``: how a row ends at a release whose post releases already differ (``host_pin_inline``: 0.5.6,
    not 0.5.6.post1, whose host pools allocate through ALLOC_MEMORY_FUNCS)."""
    before = versions.Before("0.5.6.post1")
    assert "0.5.6" in before and "0.5.3.post2" in before and "0.5.5.post3" in before
    assert "0.5.6.post1" not in before and "0.5.6.post2" not in before and "0.5.7" not in before
    assert str(before) == "before 0.5.6.post1"
    assert str(versions.Releases("0.5.3", before="0.5.6.post1")) == "since 0.5.3, before 0.5.6.post1"
    assert "0.5.2" not in versions.Releases("0.5.3", before="0.5.6.post1")
    with pytest.raises(ValueError, match="not both"):
        versions.Releases(None, "0.5.6", before="0.5.6.post1")
    assert compat.Compat("0.5.6").has("host_pin_inline")
    assert not compat.Compat("0.5.6.post1").has("host_pin_inline")


_COMMITTED = {
    "finished_len_from_output"
}  # 0.5.5.post1 on cache the committed length (0.5.5: input and output less one)
_ALLOC_TABLE = (
    {"host_pin_inline"},
    {"host_alloc_without_allocator"},
)  # ALLOC_MEMORY_FUNCS, no allocator argument
_PIN_AS_055 = ({"host_pin_at_allocation"}, {"host_pin_always"})  # 0.5.5's host pool: allocate, then register
ROWS_BOUNDED_BY_POSTS: dict[str, tuple[set[str], set[str]]] = {
    # snapshots towards 0.5.5: its memory_pool_host.py and radix_cache.py
    "0.5.4.post2": _PIN_AS_055,
    "0.5.4.post3": _PIN_AS_055,
    "0.5.5.post1": (_COMMITTED, set()),
    "0.5.5.post2": (_COMMITTED, set()),
    # a snapshot towards 0.5.6: the controller's device_module, the host pools' SUPPORT_PIN_MEMORY (host_pin_inline,
    # which 0.5.5 has too but host_pin_always takes first)
    "0.5.5.post3": ({*_COMMITTED, "controller_cuda_streams", "host_pin_always"}, set()),
    "0.5.6.post1": _ALLOC_TABLE,
    "0.5.6.post2": _ALLOC_TABLE,
}
"""Post release -> (its base's rows that end before it, rows it has and its base has not)."""

PROFILES_BOUNDED_BY_POSTS: dict[str, set[str]] = {
    # memory_pool_host.py 0.5.5.post3:70-72 rounds the host pool up a page, as 0.5.6 (D-56 ends before it)
    "0.5.5.post3": {"host_pool_rounded_down"},
}
"""Post release -> the fidelity options its profile sets otherwise than its base release's (a decision's bound
written as a post release)."""

DRIVEN_POSTS = [post for post in versions.POST_RELEASES if post not in versions.POSTS_NOT_DRIVEN]


def test_the_driven_post_releases_are_the_listed_ones_not_refused_and_each_has_a_profile() -> None:
    assert list(versions.DRIVEN_POSTS) == DRIVEN_POSTS
    assert [name for name in PROFILES if name.startswith("sglang-") and ".post" in name] == [
        f"sglang-{post}" for post in DRIVEN_POSTS
    ]
    # a post release not listed (a future one) follows its base's profile: there is none of its own
    assert versions.place(f"{NEWEST}.post7").profile == f"sglang-{NEWEST}"


@pytest.mark.parametrize("post", DRIVEN_POSTS)
def test_every_post_release_is_driven_with_its_base_row_profile_and_rows(post: str) -> None:
    base = post.rpartition(".post")[0]
    placed = versions.place(post)
    assert (placed.kind, placed.row, placed.rows, placed.profile) == (
        "post",
        versions.release(base),
        post,
        f"sglang-{post}",
    )
    assert versions.release(post) == versions.release(base)
    assert str(placed) == f"SGLang {post} (a post release of {base}), driven with its row"
    # its own profile: the decisions' ranges at the post release, its base's but where a bound names a post
    differs = {o for o, on in PROFILES[placed.profile].items() if PROFILES[f"sglang-{base}"][o] != on}
    assert differs == PROFILES_BOUNDED_BY_POSTS.get(post, set())
    ends_at_base, post_only = ROWS_BOUNDED_BY_POSTS.get(post, (set(), set()))
    assert compat.Compat(placed.rows).rows == (compat.Compat(base).rows - ends_at_base) | post_only
    assert ends_at_base <= compat.Compat(base).rows and not post_only & compat.Compat(base).rows
    assert compat.excluded_values(post) == compat.excluded_values(base)
    versions.check_supported(post)  # PyPI installs it: an environment is built for it
    recipe = versions.install_recipe(post)
    assert recipe[-1] == ("--no-deps", f"sglang=={post}")
    assert recipe[1][:2] == ("-c", f"constraints/sglang-{base}.txt") == recipe[2][:2]
    assert recipe[1][2:] == versions.install_recipe(base)[1][2:]  # what its base imports (RELEASE_IMPORTS)


@pytest.mark.parametrize("post", sorted(versions.POSTS_NOT_DRIVEN))
def test_a_post_release_whose_modules_moved_on_is_refused_saying_why(post: str) -> None:
    """0.5.3.post2 and .post3 are not 0.5.3's (snapshots towards 0.5.4, not read): refused, naming the base to
    install."""
    base = post.rpartition(".post")[0]
    assert post in versions.POST_RELEASES
    with pytest.raises(
        UnsupportedError, match=rf"SGLang {post} is a post release refcache does not drive with "
    ):
        versions.place(post)
    with pytest.raises(UnsupportedError, match=rf"not {base}'s.*Install {base} or a later release"):
        versions.check_supported(post)


def test_a_checkout_newer_than_the_newest_release_is_main_with_its_rows() -> None:
    newest = versions.release(NEWEST)
    for version, source in (
        ("0.5.99.dev3+gabc1234", None),  # setuptools-scm on main after a release tag
        (f"{NEWEST}.post1.dev2", None),  # a dev version after the newest release
        ("0.5.99", "/src/sglang/python"),  # a checkout whose version is a number no release has yet
        ("0.6.0.dev0", None),
    ):
        placed = versions.place(version, source=source)
        assert (placed.kind, placed.row, placed.rows, placed.profile) == (
            "main",
            newest,
            NEWEST,
            f"sglang-{NEWEST}",
        )
        assert versions.release(version) == newest if source is None else True
    assert (
        str(versions.place("0.5.99.dev3+gabc1234"))
        == f"SGLang main (0.5.99.dev3+gabc1234), driven with {NEWEST}'s rows"
    )
    assert str(versions.place("0.5.99", source="/src/python")) == (
        f"SGLang main (0.5.99, the checkout /src/python), driven with {NEWEST}'s rows"
    )
    # a checkout at a release tag is that release; a local label does not move it
    for version, source in (("0.5.10", "/src/python"), ("0.5.10+g1234.d20261205", None)):
        placed = versions.place(version, source=source)
        assert (placed.kind, placed.row, placed.rows) == ("release", versions.release("0.5.10"), "0.5.10")
    assert versions.place("0.5.10.post1+g12", source="/s").kind == "post"


@pytest.mark.parametrize(
    ("version", "source", "says"),
    [
        ("0.5.99", None, r"SGLang 0\.5\.99 is not a release refcache drives: supported are 0\.5\.3\.\."),
        ("0.6.0", None, r"SGLang 0\.6\.0 is not a release refcache drives"),
        ("0.5.1.post3", None, r"SGLang 0\.5\.1\.post3 is not a release refcache drives: supported are"),
        (
            "0.5.3.post3",
            None,
            r"SGLang 0\.5\.3\.post3 is a post release refcache does not drive with 0\.5\.3's row",
        ),
        ("0.5.2.dev2+gabc", None, r"SGLang 0\.5\.2\.dev2\+gabc is not a release refcache drives"),
        ("0.0.0.dev0", "/src", r"0\.0\.0\.dev0 is setuptools-scm's version for a checkout without its git"),
        ("0.5.15.dev1+g1", None, r"0\.5\.15\.dev1\+g1 is a source checkout between two releases"),
        (f"{NEWEST}.dev5", None, rf"{NEWEST}\.dev5 is a source checkout between two releases.*or main"),
        ("main", None, r"'main' is not a version refcache can place: it reads a release \(0\.5\.12\)"),
        ("0.5.10rc1", None, r"'0\.5\.10rc1' is not a version refcache can place"),
        ("0.5", "/src", r"'0\.5' is not a version refcache can place.*supported are 0\.5\.3\.\."),
    ],
)
def test_what_cannot_be_placed_is_refused_naming_it_and_the_supported_releases(
    version: str, source: str | None, says: str
) -> None:
    with pytest.raises(UnsupportedError, match=says) as caught:
        versions.place(version, source=source)
    assert NEWEST in str(caught.value)
    with pytest.raises(UnsupportedError):
        versions.release(version)


def test_a_checkout_version_is_placed_but_not_installed_from_pypi() -> None:
    for version in ("0.5.99.dev3+gabc", "0.5.10+gabc"):
        with pytest.raises(
            UnsupportedError, match=r"source checkout's version, not a release on PyPI.*--checkout"
        ):
            versions.install_recipe(version)


def test_the_installed_post_release_and_checkout_drive_the_systems(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(versions, "installed_version", lambda: "0.5.10.post1")
    assert versions.installed_profile() == "sglang-0.5.10.post1" and versions.installed_system() == "sglang"
    assert PROFILES["sglang-0.5.10.post1"] == PROFILES["sglang-0.5.10"]
    assert versions.installed_placement() == (
        "0.5.10.post1",
        "SGLang 0.5.10.post1 (a post release of 0.5.10), driven with its row",
    )
    assert compat.installed_excluded_values() == compat.excluded_values("0.5.10")
    assert engine_placements(("model", "sglang", "sglang-unified")) == {
        "sglang": versions.installed_placement()[1]
    }
    monkeypatch.setattr(versions, "installed_version", lambda: "0.5.99.dev3+gabc")
    assert versions.installed_system() == versions.release(NEWEST).system
    assert versions.installed_unified_profile() == f"sglang-{NEWEST}"
    assert SYSTEMS["sglang-unified"].placed() == (
        NEWEST,
        f"SGLang main (0.5.99.dev3+gabc), driven with {NEWEST}'s rows",
    )
    monkeypatch.setattr(versions, "installed_version", lambda: "0.5.20")
    assert versions.installed_placement() == ("0.5.20", "")  # a release as published: nothing to say
    assert engine_placements(("model", "sglang")) == {}
    monkeypatch.setattr(versions, "installed_version", lambda: "0.5.15.dev1")
    assert engine_placements(("model", "sglang")) == {}  # not placed: the open says why
    with pytest.raises(UnsupportedError, match="between two releases"):
        versions.installed_system()


def _distribution(site: Path, version: str, direct_url: dict[str, object] | None) -> None:
    info = site / f"sglang-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: sglang\nVersion: {version}\n")
    if direct_url is not None:
        (info / "direct_url.json").write_text(json.dumps(direct_url))


def test_an_installed_checkout_is_found_from_its_direct_url(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pip writes PEP 610's direct_url.json for an install from a directory (``-e`` or not): the checkout
    is named, and a version no release has is main; a wheel from an index has none."""
    site = tmp_path / "site"
    url: dict[str, object] = {"url": "file:///src/my%20sglang/python", "dir_info": {"editable": True}}
    _distribution(site, "0.5.99", url)
    monkeypatch.syspath_prepend(str(site))
    assert versions.installed_version() == "0.5.99"
    assert versions.installed_source() == "/src/my sglang/python"
    placed = versions.installed()
    assert (placed.kind, placed.source, placed.rows) == ("main", "/src/my sglang/python", NEWEST)
    assert versions.installed_placement()[1] == (
        f"SGLang main (0.5.99, the checkout /src/my sglang/python), driven with {NEWEST}'s rows"
    )


def test_an_installed_wheel_names_no_checkout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    site = tmp_path / "site"
    _distribution(site, "0.5.99", {"url": "https://files.pythonhosted.org/x.whl", "archive_info": {}})
    monkeypatch.syspath_prepend(str(site))
    assert versions.installed_source() is None
    with pytest.raises(UnsupportedError, match=r"SGLang 0\.5\.99 is not a release refcache drives"):
        versions.installed()


def _tree(root: Path, pyproject: str = '[project]\nname = "sglang"\ndynamic = ["version"]\n') -> Path:
    (root / "python" / "sglang").mkdir(parents=True)
    (root / "python" / "pyproject.toml").write_text(pyproject)
    return root


def test_a_source_tree_s_version_and_its_recipe(tmp_path: Path) -> None:
    """The version is read without building: an sdist's PKG-INFO, a static pyproject version, or the
    sglang/_version.py a build left; the recipe is the release recipe with the tree installed -e last, pinned
    by the constraints of the row that will drive it."""
    tree = _tree(tmp_path / "a", '[project]\nname = "sglang"\nversion = "0.5.99.dev3+gabc"\n')
    assert versions.checkout_version(tree) == versions.checkout_version(tree / "python") == "0.5.99.dev3+gabc"
    recipe = versions.checkout_recipe(tree)
    assert recipe[-1] == ("--no-deps", "-e", str((tree / "python").resolve()))
    assert recipe[:-1] == versions.install_recipe(NEWEST)[:-1]
    sdist = tmp_path / "sglang-0.5.10.post1"
    (sdist / "sglang").mkdir(parents=True)
    (sdist / "pyproject.toml").write_text('[project]\nname = "sglang"\ndynamic = ["version"]\n')
    (sdist / "PKG-INFO").write_text("Metadata-Version: 2.4\nName: sglang\nVersion: 0.5.10.post1\n")
    assert versions.checkout_version(sdist) == "0.5.10.post1"
    assert versions.checkout_recipe(sdist)[:-1] == versions.install_recipe("0.5.10.post1")[:-1]
    built = _tree(tmp_path / "b")
    (built / "python" / "sglang" / "_version.py").write_text("__version__ = version = '0.5.99.dev1+g1'\n")
    assert versions.checkout_version(built) == "0.5.99.dev1+g1"
    with pytest.raises(UsageError, match="no version found"):
        versions.checkout_version(_tree(tmp_path / "c"))
    with pytest.raises(UsageError, match="is not an SGLang source tree"):
        versions.checkout_version(tmp_path)
    old = _tree(tmp_path / "d", '[project]\nname = "sglang"\nversion = "0.5.15.dev2"\n')
    with pytest.raises(UnsupportedError, match="between two releases"):
        versions.checkout_recipe(old)


def test_bisect_lists_post_releases_when_asked_and_places_them_on_their_system() -> None:
    everything = choose_releases(versions, "0.5.9..0.5.11", post=True)
    assert everything == ["0.5.9", "0.5.10", "0.5.10.post1", "0.5.11"]
    assert choose_releases(versions, "0.5.9..0.5.11") == ["0.5.9", "0.5.10", "0.5.11"]
    assert choose_releases(versions, "0.5.10.post1..0.5.11") == ["0.5.10.post1", "0.5.11"]  # an end, named
    assert choose_releases(versions, "0.5.10.post1") == ["0.5.10.post1"]
    assert set(versions.POST_RELEASES) <= set(choose_releases(versions, None, post=True))
    # a post release or a checkout runs the system that drives the release whose row drives it
    assert system_for("sglang", f"{NEWEST}.post1", versions) == versions.release(NEWEST).system
    assert system_for("sglang", "0.5.99.dev3+gabc", versions) == versions.release(NEWEST).system
    assert system_for("sglang", "0.5.10.post1", versions) == "sglang"


def test_a_trace_records_the_exact_version_and_how_it_was_placed(tmp_path: Path) -> None:
    from refcache.config import HiCacheConfig
    from refcache.errors import TraceFormatError
    from refcache.hicache.ops import Evict
    from refcache.hicache.recording import Recording, read_recording, write_recording
    from refcache.hicache.trace import read_trace, stamp_release, trace_release, write_trace

    path = tmp_path / "t.jsonl"
    write_trace(path, HiCacheConfig(), [Evict(1)])
    words = str(versions.place("0.5.99.dev3+gabc"))
    stamp_release(path, "sglang", "0.5.99.dev3+gabc", words)
    assert trace_release(path) == ("sglang", "0.5.99.dev3+gabc")
    assert f'"placed": "{words}"' in path.read_text().splitlines()[0]
    assert read_trace(path) == (HiCacheConfig(), [Evict(1)])
    path.write_text(path.read_text().replace('"placed"', '"where"'))
    with pytest.raises(TraceFormatError, match="release must be"):  # another key is still refused
        read_trace(path)
    recorded = tmp_path / "r.jsonl"
    source = {"engine": "sglang", "version": "0.5.10.post1", "placed": str(versions.place("0.5.10.post1"))}
    write_recording(recorded, Recording(HiCacheConfig(), [Evict(1)], [None], [None], source))
    assert read_recording(recorded).source == source


def test_bisect_refuses_a_checkout_it_cannot_place_before_building_anything(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from refcache.cli import app

    between = _tree(tmp_path / "between", '[project]\nname = "sglang"\nversion = "0.5.15.dev2"\n')
    for tree, says in ((between, "between two releases"), (tmp_path, "is not an SGLang source tree")):
        result = CliRunner().invoke(
            app, ["bisect", "--fuzz", "--checkout", str(tree)], env={"COLUMNS": "400"}
        )
        assert result.exit_code == 2, result.output
        assert says in " ".join(result.output.split()), result.output
