"""The static half of `python -m fmha_rt check`: the ABIs between the project's own pieces, read from
the sources and the manifest without a GPU or a compiler.

- every call into the shim from Python (`lib.fmha_*(...)`) and every `fmha_*` function the XLA handler
  (xla_ffi.c) or the launch-program loader (program.c) calls or defines names a function of
  include/fmha_rt.h with its number of parameters;
- every portable and v3 code object of the manifest declares the parameters (names, types, order) that
  the plan packs for its function (plan/abi.SIGNATURES, then the compiler's scratch pointers); the
  code objects' own kernarg layout is compared with the manifest by abi_check;
- the launch-program format constants of fmha_rt/replay/program.py equal the shim's (csrc/program.h).
"""
from __future__ import annotations

import ast
import pathlib
import re

from .runtime.packing import SLOT_TYPES

HEADER = pathlib.Path("include", "fmha_rt.h")
PYTHON_SOURCES = "fmha_rt"
XLA_HANDLER = pathlib.Path("fmha_rt", "csrc", "xla_ffi.c")
PROGRAM_LOADER = pathlib.Path("fmha_rt", "csrc", "program.c")
PROGRAM_HEADER = pathlib.Path("fmha_rt", "csrc", "program.h")
LAUNCH_PROGRAM = pathlib.Path("fmha_rt", "replay", "program.py")
# program.py's constant -> (program.h's #define, what the shim's value is to it)
PROGRAM_CONSTANTS = {"MAGIC": ("PROGRAM_MAGIC", 0), "FORMAT": ("PROGRAM_FORMAT", 0), "MAX_VALUES": ("MAX_VALUES", 0),
                     "MAX_LAUNCHES": ("MAX_LAUNCHES", 0), "MAX_PATCHES": ("MAX_PATCHES", 0),
                     "MAX_OVERLAPS": ("MAX_OVERLAPS", 0), "MAX_LABEL_BYTES": ("LABEL_CHARS", -1)}  # LABEL_CHARS holds a NUL
SIGNATURE_SLOT_TYPES = {"i32": "i32", "i64": "i64", "fp32": "f32"}  # SIGNATURES' scalar kinds; pointers are "*..."
PLANNED_FAMILIES = ("portable", "v3")


def _without_comments(c_text: str) -> str:
    """C text with comments blanked and string literals emptied; lines keep their numbers."""
    c_text = re.sub(r"/\*.*?\*/", lambda m: " " + "\n" * m.group(0).count("\n"), c_text, flags=re.S)
    c_text = re.sub(r"//[^\n]*", " ", c_text)
    return re.sub(r'"(?:\\.|[^"\\])*"', '""', c_text)


def _split_top_level(text: str) -> list[str]:
    """`text` split at the commas outside parentheses (function-pointer parameters hold commas)."""
    parts, depth, current = [], 0, ""
    for ch in text:
        depth += (ch == "(") - (ch == ")")
        if ch == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    return [p.strip() for p in parts + [current] if p.strip()]


def _parameter_count(parameters: str) -> int:
    parts = _split_top_level(parameters)
    return 0 if parts in ([], ["void"]) else len(parts)


_FUNCTION = re.compile(r"\b(fmha_\w+)\s*\(")


def _calls_and_definitions(c_text: str):
    """(name, parameter or argument count, line) of every `fmha_*(...)` in C source without comments."""
    for match in _FUNCTION.finditer(c_text):
        depth, end = 1, match.end()
        while depth and end < len(c_text):
            depth += (c_text[end] == "(") - (c_text[end] == ")")
            end += 1
        yield match.group(1), _parameter_count(c_text[match.end():end - 1]), c_text.count("\n", 0, match.start()) + 1


def header_functions(header_text: str) -> dict[str, int]:
    """{function: parameter count} of every `fmha_*` prototype (a declaration ending in ';')."""
    text = _without_comments(header_text)
    functions = {}
    for match in re.finditer(r"^[ \t]*(?:[\w\s]*?\*?\s*)(fmha_\w+)\s*\(([^;{]*?)\)\s*;", text, flags=re.M):
        functions[match.group(1)] = _parameter_count(match.group(2))
    return functions


def python_shim_calls(path: pathlib.Path):
    """(function, positional argument count or None where a *args hides it, line) of every
    `lib.fmha_*(...)` or `<x>.lib.fmha_*(...)` call in the Python file."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr.startswith("fmha_")):
            continue
        owner = node.func.value
        if (isinstance(owner, ast.Name) and owner.id == "lib") or (isinstance(owner, ast.Attribute) and owner.attr == "lib"):
            starred = any(isinstance(a, ast.Starred) for a in node.args)
            yield node.func.attr, None if starred else len(node.args), node.lineno


def _shim_call_problems(root: pathlib.Path, functions: dict[str, int]) -> tuple[int, list[str]]:
    calls, problems = 0, []

    def compare(where, name, count):
        if name not in functions:
            problems.append(f"{where}: {name} is not declared in {HEADER}")
        elif count is not None and count != functions[name]:
            problems.append(f"{where}: {name} with {count} argument(s); {HEADER} declares {functions[name]}")

    for path in sorted((root / PYTHON_SOURCES).rglob("*.py")):
        for name, count, line in python_shim_calls(path):
            calls += 1
            compare(f"{path.relative_to(root)}:{line}", name, count)
    for source in (XLA_HANDLER, PROGRAM_LOADER):
        for name, count, line in _calls_and_definitions(_without_comments((root / source).read_text())):
            calls += 1
            compare(f"{source}:{line}", name, count)
    return calls, problems


def _python_constants(path: pathlib.Path) -> dict:
    """Module-level `NAME = <literal or int.from_bytes(b'...', 'little')>` assignments."""
    constants = {}
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            value = node.value
            if isinstance(value, ast.Call) and ast.unparse(value.func) == "int.from_bytes":
                constants[node.targets[0].id] = int.from_bytes(*(ast.literal_eval(a) for a in value.args))
            elif isinstance(value, ast.Constant):
                constants[node.targets[0].id] = value.value
    return constants


def _c_defines(c_text: str) -> dict[str, int]:
    return {m.group(1): int(m.group(2), 0)
            for m in re.finditer(r"^#define\s+(\w+)\s+(0x[0-9A-Fa-f]+|\d+)(?:LL|ULL|L|U)?\b", c_text, flags=re.M)}


def _program_constant_problems(root: pathlib.Path) -> list[str]:
    python, c = _python_constants(root / LAUNCH_PROGRAM), _c_defines(_without_comments((root / PROGRAM_HEADER).read_text()))
    problems = []
    for name, (define, adjust) in PROGRAM_CONSTANTS.items():
        if name not in python or define not in c:
            problems.append(f"launch program: {LAUNCH_PROGRAM} {name} or {PROGRAM_HEADER} {define} is missing")
        elif python[name] != c[define] + adjust:
            problems.append(f"launch program: {LAUNCH_PROGRAM} {name} = {python[name]:#x} but {PROGRAM_HEADER} "
                            f"{define} = {c[define]:#x}" + (f" (its value {adjust:+d})" if adjust else ""))
    return problems


def planned_slots(signature: dict) -> list[tuple[str, str]]:
    """(name, manifest slot type) of the runtime parameters of a SIGNATURES entry, in order."""
    return [(name, "ptr" if kind.startswith("*") else SIGNATURE_SLOT_TYPES[kind])
            for name, kind in signature.items() if kind != "constexpr"]


def kernel_signature_problems(kernels, signatures: dict, scratch_pointers: tuple) -> tuple[int, list[str]]:
    """Compare the parameters of each planned family's kernel (registry.KernelEntry) with its function's
    planned signature."""
    checked, problems = 0, []
    for kernel in kernels:
        if kernel.family not in PLANNED_FAMILIES:
            continue
        checked += 1
        where = f"{kernel.arch}/{kernel.key}"
        if kernel.symbol not in signatures:
            problems.append(f"{where}: function {kernel.symbol} has no planned signature")
            continue
        have = [(p.name, p.type) for p in kernel.params if p.name not in scratch_pointers]
        want = planned_slots(signatures[kernel.symbol])
        if have != want:
            first = next((i for i, (a, b) in enumerate(zip(have, want)) if a != b), min(len(have), len(want)))
            problems.append(f"{where}: parameter {first} is {have[first] if first < len(have) else 'missing'} in the "
                            f"manifest, the plan packs {want[first] if first < len(want) else 'nothing there'}")
        bad_types = [p.type for p in kernel.params if p.type not in SLOT_TYPES]
        if bad_types:
            problems.append(f"{where}: parameter types {bad_types} are not packable ({', '.join(SLOT_TYPES)})")
    return checked, problems


def check_sources(root: pathlib.Path, kernels, signatures: dict, scratch_pointers: tuple) -> tuple[list[str], bool]:
    """(report lines, all agree) for the source tree at `root` and the manifest's `kernels` (KernelEntry)."""
    header = root / HEADER
    if not header.is_file() or not (root / XLA_HANDLER).is_file():
        return [f"source ABI checks: skipped ({HEADER} and {XLA_HANDLER} are not in this installation)"], True
    calls, problems = _shim_call_problems(root, header_functions(header.read_text()))
    problems += _program_constant_problems(root)
    checked, kernel_problems = kernel_signature_problems(kernels, signatures, scratch_pointers)
    problems += kernel_problems
    lines = [f"source ABI checks: {'all pass' if not problems else f'{len(problems)} FAIL'} ({calls} shim calls "
             f"against {HEADER}, {len(PROGRAM_CONSTANTS)} launch-program constants, {checked} planned kernel "
             "signatures against the manifest)"]
    return lines + [f"  FAIL {p}" for p in problems], not problems
