"""Property-based fuzzing of the manifest reader with hostile hsa folders, on the CPU.

Each case is a private copy of the committed self-test code objects with a manifest that Hypothesis
spoils: fields missing or of the wrong type, absurd sizes, non-finite numbers, absolute or escaping file
names, symlinks (outside, looping, dangling), files that are directories, code objects whose sha256 is
right but whose bytes are not gzip or not a code object, duplicate kernels and duplicate JSON keys,
deep nesting, documents that are not objects, bytes that are not JSON. The property: reading the folder
(Registry), every entry's image and every entry's argument packer either work or raise an FmhaError
subclass; nothing else ever comes out. parse_manifest is also fed Python objects no JSON file holds.
FMHA_RT_FUZZ_EXAMPLES scales the examples per test (default below).
"""
import collections
import copy
import gzip
import hashlib
import itertools
import json
import math
import os
import pathlib
import shutil

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from fmha_rt.runtime import registry as registry_module
from fmha_rt.errors import FmhaError
from fmha_rt.runtime.packing import ArgPacker

REPO = pathlib.Path(__file__).resolve().parents[2]
COMMITTED = REPO / "hsa"
EXAMPLES = int(os.environ.get("FMHA_RT_FUZZ_EXAMPLES", "1500"))
PHASES = tuple(Phase) if os.environ.get("FMHA_RT_FUZZ_SHRINK") == "1" else (Phase.explicit, Phase.generate)
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True, phases=PHASES,
                suppress_health_check=list(HealthCheck))

FIELDS = ("key", "family", "arch", "symbol", "file", "sha256", "compressed", "threads", "shared", "params",
          "param_bytes", "traits")
PARAM_FIELDS = ("name", "type", "offset", "size")
# Numbers at and past every limit the reader knows. Offsets stay below 2**20 or at 2**40 and beyond: a
# packer builds its layout string before checking the total, and sizes in between would really be allocated.
EDGE_NUMBERS = [0, -1, 1, 8, 1024, 1025, 4096, 4097, 1 << 20, (1 << 20) + 1, 2**31, 2**40, 2**63, 2**64,
                10**400, 0.5, 1e308, math.inf, -math.inf, math.nan, True, False]
HOSTILE_NAMES = ["/etc/passwd", "../outside.gz", "sm_90/../../outside.gz", "", "\\\\host\\share", "a\x00b",
                 "~", ".", "sm_90", "x" * 5000, "sm_90/selftest/", "./sm_90/selftest/../selftest/none.gz",
                 "\u00e9t\u00e9.gz", " ", "//double.gz", "sm_90\\selftest\\x.gz"]
SLOT_TYPES = ["ptr", "i32", "u32", "i64", "u64", "f32", "f64", "fp32", "", "PTR", 4]

json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), st.sampled_from(EDGE_NUMBERS),
                         st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20),
                         st.sampled_from(HOSTILE_NAMES))
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=4) |
                           st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """(folder with the committed self-test code objects, their manifest document). The files sit flat in
    the folder: a case then costs one directory, which is most of its file-system time."""
    manifest = json.loads((COMMITTED / "manifest.json").read_text())
    kernels = [k for k in manifest["kernels"] if k["family"] == "selftest"]
    assert kernels, "the committed manifest lists no self-test kernels"
    root = tmp_path_factory.mktemp("selftest") / "hsa"
    root.mkdir()
    for k in kernels:
        committed, k["file"] = k["file"], k["file"].replace("/", "-")
        shutil.copy(COMMITTED / committed, root / k["file"])
    return root, {"format": manifest["format"], "triton": manifest.get("triton"), "kernels": kernels}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("hostile")


def exercise(root) -> str:
    """Read `root` as the runtime does: the registry, then every entry's image and packer. Returns what
    happened; any exception that is not an FmhaError propagates and fails the test."""
    try:
        reg = registry_module.Registry(root)
    except FmhaError as exc:
        return f"folder refused ({type(exc).__name__})"
    reg.archs()
    refusals = []
    for (arch, key), entry in reg.entries.items():
        assert reg.entry(arch, key) is entry and entry in reg.kernels_for(arch)
        try:
            # What entry.packer builds (that property caches by (arch, key) per process, so not used here),
            # in the executor's order: the packer before the image.
            ArgPacker(list(entry.params), entry.param_bytes)
            reg.image(entry)
        except FmhaError as exc:
            refusals.append(type(exc).__name__)
    if not reg.entries:
        return "folder read, no kernels"
    return f"an image refused ({refusals[0]})" if refusals else "every image loaded"


class Hostile:
    """Spoils a copy of the pristine folder and its manifest, one labelled draw at a time."""

    def __init__(self, data, root, document, outside, code_objects):
        self.data, self.root, self.doc, self.outside = data, root, document, outside
        self.code_objects = code_objects  # file name -> the pristine code object's bytes
        self.raw = None  # manifest bytes that replace the JSON document

    def __call__(self, strategy, label):
        return self.data.draw(strategy, label=label)

    def kernel(self):
        """A kernel entry to spoil, or None when the document no longer holds a list of them."""
        kernels = self.doc.get("kernels") if isinstance(self.doc, dict) else None
        if not kernels or not isinstance(kernels, list) or not all(isinstance(k, dict) for k in kernels):
            return None
        return kernels[self(st.integers(0, len(kernels) - 1), "kernel")]

    def pristine_file(self, k) -> bool:
        """Whether the entry still names one of the copied code objects, as a plain file."""
        name = k.get("file")
        if not isinstance(name, str) or name not in self.code_objects:
            return False
        path = self.root / name
        return path.is_file() and not path.is_symlink()

    def restamp(self, entry, stored: bytes, compressed: bool):
        """Write `stored` as the entry's file with a matching sha256: the hash check passes, what follows
        must refuse the bytes."""
        path = self.root / entry["file"]
        path.unlink()  # the case's files are hard links to the pristine copy: never write through them
        path.write_bytes(stored)
        entry["sha256"], entry["compressed"] = hashlib.sha256(stored).hexdigest(), compressed

    # Every mutation takes the kernel entry it spoils (None when the document has none left).

    def field(self, k):
        name = self(st.sampled_from(FIELDS), "field")
        if self(st.booleans(), "delete it?"):
            k.pop(name, None)
        else:
            k[name] = self(json_values if name != "params" else st.lists(json_values, max_size=3), f"{name} =")

    def number(self, k):
        k[self(st.sampled_from(["threads", "shared", "param_bytes"]), "size field")] = self(
            st.sampled_from(EDGE_NUMBERS), "size")

    def param(self, k):
        params = k.get("params")
        if not isinstance(params, list) or not params:
            return
        p = params[self(st.integers(0, len(params) - 1), "param")]
        if not isinstance(p, dict):
            return
        name = self(st.sampled_from(PARAM_FIELDS), "param field")
        values = {"type": st.sampled_from(SLOT_TYPES) | json_values, "name": json_values,
                  "offset": st.sampled_from(EDGE_NUMBERS), "size": st.sampled_from(EDGE_NUMBERS)}[name]
        if self(st.booleans(), "delete it?"):
            p.pop(name, None)
        else:
            p[name] = self(values, f"param {name} =")

    def params_list(self, k):
        params = k.get("params")
        if not isinstance(params, list) or not params:
            return
        how = self(st.sampled_from(["drop", "duplicate", "reverse", "empty", "many"]), "params")
        if how == "drop":
            params.pop(self(st.integers(0, len(params) - 1), "dropped"))
        elif how == "duplicate":
            params.append(copy.deepcopy(params[0]))
        elif how == "reverse":
            params.reverse()
        elif how == "empty":
            params.clear()
        else:
            params.extend({"name": f"p{i}", "type": "i32", "offset": 4 * i, "size": 4} for i in range(2000))

    def file_name(self, k):
        k["file"] = self(st.sampled_from(HOSTILE_NAMES), "file name")

    def file_system(self, k):
        """The entry's file made a symlink (outside, looping, dangling, to a sibling), a directory, missing,
        or bytes with the right sha256 that are not gzip, a truncated or corrupt gzip, not a code object,
        another kernel's code object."""
        if not self.pristine_file(k):
            return
        path = self.root / k["file"]
        trick = self(st.sampled_from(["link outside", "link loop", "link dangling", "link sibling", "directory",
                                      "missing", "not gzip", "truncated gzip", "corrupt gzip", "not an ELF",
                                      "flipped bytes", "other kernel", "empty"]), "file trick")
        data = self.code_objects[k["file"]]
        if trick.startswith("link"):
            targets = {"link outside": self.outside, "link loop": path, "link dangling": path.with_name("gone"),
                       "link sibling": path.with_name("sibling.gz")}
            targets["link sibling"].write_bytes(gzip.compress(data, mtime=0))
            path.unlink()
            path.symlink_to(targets[trick])
        elif trick == "directory":
            path.unlink()
            path.mkdir()
        elif trick == "missing":
            path.unlink()
        elif trick == "not gzip":
            self.restamp(k, data, compressed=True)
        elif trick == "truncated gzip":
            stored = gzip.compress(data, mtime=0)
            self.restamp(k, stored[:self(st.integers(0, len(stored) - 1), "cut at")], compressed=True)
        elif trick == "corrupt gzip":
            stored = bytearray(gzip.compress(data, mtime=0))
            stored[self(st.integers(10, len(stored) - 9), "corrupt byte")] ^= 0x5A
            self.restamp(k, bytes(stored), compressed=True)
        elif trick == "not an ELF":
            self.restamp(k, self(st.binary(max_size=256), "bytes"), compressed=self(st.booleans(), "gzip it?"))
        elif trick == "flipped bytes":
            flipped = bytearray(data)
            for _ in range(self(st.integers(1, 8), "flips")):
                flipped[self(st.integers(0, len(flipped) - 1), "flip at")] ^= 1 << self(st.integers(0, 7), "bit")
            self.restamp(k, gzip.compress(bytes(flipped), mtime=0), compressed=True)
        elif trick == "other kernel":
            other = self(st.sampled_from(sorted(self.code_objects)), "other kernel's file")
            self.restamp(k, gzip.compress(self.code_objects[other], mtime=0), compressed=True)
        else:
            self.restamp(k, b"", compressed=self(st.booleans(), "gzip it?"))

    def benign(self, k):
        """A change the reader must take in its stride: other traits, an unknown field, an uncompressed
        code object, a './' path, a renamed key, kernels in another order."""
        how = self(st.sampled_from(["traits", "unknown field", "uncompressed", "dotted path", "renamed key",
                                    "reordered"]), "benign change")
        if how == "traits":
            k["traits"] = self(st.dictionaries(st.text(max_size=8), json_values, max_size=4), "traits =")
        elif how == "unknown field":
            k[self(st.text(max_size=8).filter(lambda name: name not in FIELDS), "unknown field")] = self(
                json_values, "unknown field =")
        elif how == "uncompressed" and self.pristine_file(k):
            self.restamp(k, self.code_objects[k["file"]], compressed=False)
        elif how == "dotted path" and isinstance(k.get("file"), str):
            k["file"] = "./" + k["file"]
        elif how == "renamed key":
            k["key"] = f"{k.get('key')}_renamed"
        elif how == "reordered":
            self.doc["kernels"].reverse()

    def duplicate(self, k):
        twin = copy.deepcopy(k)
        if self(st.booleans(), "other arch?"):
            twin["arch"] = "sm_91"
        self.doc["kernels"].append(twin)

    def document(self, _):
        """The whole document: not an object, a wrong format or kernels list, deep nesting, duplicate
        keys, or bytes that are not JSON (or not UTF-8)."""
        ways = ["value", "bytes", "manifest is a directory"]
        if isinstance(self.doc, dict):  # not spoilt into another kind already
            ways += ["format", "kernels", "deep", "duplicate keys", "bom"]
        how = self(st.sampled_from(ways), "document")
        if how == "value":
            self.doc = self(json_values, "document =")
        elif how == "format":
            self.doc["format"] = self(json_values, "format =")
        elif how == "kernels":
            self.doc["kernels"] = self(json_values | st.lists(json_values, max_size=3), "kernels =")
        elif how == "deep":
            depth = self(st.sampled_from([10, 100, 900, 5000, 100000]), "depth")
            where = self(st.sampled_from(["document", "traits"]), "deep where")
            nest = "[" * depth + "]" * depth
            if where == "document":
                self.raw = nest.encode()
            else:
                text = json.dumps(self.doc)
                self.raw = text.replace('"traits": {', f'"traits": {{"deep": {nest}, ', 1).encode()
        elif how == "duplicate keys":
            text = json.dumps(self.doc)
            self.raw = (text[:-1] + ', "kernels": ' + json.dumps(self(json_values, "second kernels =")) + "}").encode()
        elif how == "bytes":
            self.raw = self(st.binary(max_size=200), "manifest bytes")
        elif how == "bom":
            self.raw = b"\xef\xbb\xbf" + json.dumps(self.doc).encode()
        else:
            self.raw = "directory"

    def write(self):
        path = self.root / "manifest.json"
        if self.raw == "directory":
            path.mkdir()
        else:
            path.write_bytes(self.raw if self.raw is not None else json.dumps(self.doc).encode())


MUTATIONS = [Hostile.field, Hostile.number, Hostile.param, Hostile.params_list, Hostile.file_name,
             Hostile.file_system, Hostile.duplicate, Hostile.document, Hostile.benign, Hostile.benign]


def test_fuzz_hostile_hsa_folders(pristine, workdir, record_property):
    source, document = pristine
    outside = workdir / "outside.cubin.gz"
    outside.write_bytes((source / document["kernels"][0]["file"]).read_bytes())
    code_objects = {k["file"]: gzip.decompress((source / k["file"]).read_bytes()) for k in document["kernels"]}
    cases = itertools.count()
    tally = collections.Counter()

    @FUZZ
    @given(st.data())
    def one_folder(data):
        root = workdir / f"hsa{next(cases)}"
        shutil.copytree(source, root, copy_function=os.link)
        hostile = Hostile(data, root, copy.deepcopy(document), outside, code_objects)
        for _ in range(data.draw(st.sampled_from([0, 1, 1, 2, 2, 3]), label="mutations")):
            mutation = data.draw(st.sampled_from(MUTATIONS), label="mutation")
            kernel = hostile.kernel()
            if kernel is not None or mutation is Hostile.document:
                mutation(hostile, kernel)
        hostile.write()
        tally[exercise(root)] += 1
        shutil.rmtree(root, ignore_errors=True)

    one_folder()
    for k in document["kernels"]:  # the cases wrote beside their hard links, never through them
        assert hashlib.sha256((source / k["file"]).read_bytes()).hexdigest() == k["sha256"], k["file"]
    total = sum(tally.values())
    print(f"\nhostile hsa folders: {total} cases: " + ", ".join(f"{k} {v}" for k, v in tally.most_common()))
    record_property("fuzzed_folders", total)
    assert total >= EXAMPLES
    # Every stage must see hostile input often enough to mean something.
    for stage in ("folder refused", "an image refused", "every image loaded"):
        assert sum(v for k, v in tally.items() if k.startswith(stage)) >= total // 20, (stage, tally)


def parse(document, root) -> str:
    """parse_manifest, then every entry's packer; any exception that is not an FmhaError propagates."""
    try:
        for entry in registry_module.parse_manifest(document, root).values():
            ArgPacker(list(entry.params), entry.param_bytes)
    except FmhaError as exc:
        return f"refused ({type(exc).__name__})"
    return "accepted"


python_values = st.recursive(
    json_scalars | st.binary(max_size=8) | st.just(object()) | st.tuples(st.integers(0, 8)),
    lambda inner: st.lists(inner, max_size=3) | st.tuples(inner, inner) | st.frozensets(st.integers(), max_size=3)
    | st.dictionaries(st.sampled_from(FIELDS + PARAM_FIELDS) | st.text(max_size=4), inner, max_size=5),
    max_leaves=15)


def test_fuzz_parse_manifest_with_python_objects(pristine, record_property):
    """parse_manifest takes an already decoded document: feed it objects JSON never yields (bytes, tuples,
    sets, bare objects) in every place, besides the pristine entries with one field replaced."""
    source, document = pristine
    tally = collections.Counter()

    @FUZZ
    @given(st.data())
    def one_document(data):
        doc = copy.deepcopy(document)
        where = data.draw(st.sampled_from(["document", "kernels", "kernel", "field", "param"]), label="where")
        value = data.draw(python_values, label="value")
        k = doc["kernels"][data.draw(st.integers(0, len(doc["kernels"]) - 1), label="kernel")]
        if where == "document":
            doc = value
        elif where == "kernels":
            doc["kernels"] = value
        elif where == "kernel":
            doc["kernels"].append(value)
        elif where == "field":
            k[data.draw(st.sampled_from(FIELDS), label="field")] = value
        else:
            k["params"][data.draw(st.integers(0, len(k["params"]) - 1), label="param")][
                data.draw(st.sampled_from(PARAM_FIELDS), label="param field")] = value
        tally[parse(doc, source)] += 1

    one_document()
    total = sum(tally.values())
    print(f"\nparse_manifest documents: {total} cases: " + ", ".join(f"{k} {v}" for k, v in tally.most_common()))
    record_property("fuzzed_documents", total)
    assert total >= EXAMPLES and tally["accepted"] and total - tally["accepted"] >= total // 4, tally


# ----------------------------------------------------------------------------- folders fuzzing found
# Each once let a non-FmhaError out; kept as plain cases so that a regression names itself. A case
# spoils the first sm_90 entry of a pristine copy and returns the manifest bytes to write, or None.


def _first(doc):
    return next(k for k in doc["kernels"] if k["arch"] == "sm_90")


def _restamp(root, k, stored, compressed=True):
    (root / k["file"]).write_bytes(stored)
    k["sha256"], k["compressed"] = hashlib.sha256(stored).hexdigest(), compressed


def _set(field, value):
    return lambda doc, root: _first(doc).__setitem__(field, value)


def _set_param(field, value):
    return lambda doc, root: _first(doc)["params"][1].__setitem__(field, value)


def _symlink_loop(doc, root):
    path = root / _first(doc)["file"]
    path.unlink()
    path.symlink_to(path)


def _code_object_from(transform):
    def spoil(doc, root):
        k = _first(doc)
        _restamp(root, k, transform(gzip.decompress((root / k["file"]).read_bytes())))
    return spoil


FOUND = {
    "a size that is Infinity": _set("threads", math.inf),
    "a parameter offset that is Infinity": _set_param("offset", math.inf),
    "a parameter offset past any memory (packer layout)": _set_param("offset", 2**40),
    "a parameter type that is a list": _set_param("type", ["ptr"]),
    "a file name with a NUL byte": _set("file", "sm_90/selftest/a\x00b.cubin.gz"),
    "a file that is a symlink loop": _symlink_loop,
    "nesting deeper than the JSON decoder's recursion": lambda doc, root: b"[" * 100000 + b"]" * 100000,
    "right sha256, bytes not gzip": _code_object_from(lambda elf: elf),
    "right sha256, truncated gzip": _code_object_from(lambda elf: gzip.compress(elf, mtime=0)[:-9]),
    "right sha256, corrupt deflate stream": _code_object_from(
        lambda elf: gzip.compress(elf, mtime=0)[:10] + b"\xff" * 20),
}


@pytest.mark.parametrize("name", FOUND)
def test_folders_found_by_fuzzing_raise_only_fmha_errors(pristine, tmp_path, name):
    source, document = pristine
    root = tmp_path / "hsa"
    shutil.copytree(source, root)
    doc = copy.deepcopy(document)
    raw = FOUND[name](doc, root)
    (root / "manifest.json").write_bytes(raw if raw is not None else json.dumps(doc).encode())
    assert exercise(root) != "every image loaded"
