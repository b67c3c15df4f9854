"""Reading back what FMHA_RT_LOG_CONFIG logs of each API call (fmha_rt/call_log.py)."""


def logged_calls(records) -> list[dict]:
    """The fields of every `call name=value ...` line among log records, in order."""
    lines = [r.getMessage() for r in records if r.name == "fmha_rt"]
    return [dict(field.split("=", 1) for field in line.split()[1:]) for line in lines if line.startswith("call ")]
