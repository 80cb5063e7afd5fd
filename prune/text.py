"""How numbers read in the tool's tables and summaries (reports, model cards, the CLI's tables)."""


def number(value, digits: int = 2, suffix: str = "", whole: bool = False) -> str:
    """`value` with `digits` decimals and `suffix`: "-" for None, a bool as yes / NO, an int as it is when
    `whole` (else with decimals, as a float), anything else as text."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float) or (isinstance(value, int) and not whole):
        return f"{value:.{digits}f}{suffix}"
    return f"{value}{suffix}"


def plus_minus(error: float | None, digits: int = 2) -> str:
    """" +- error" with `digits` decimals, or "" when the error is unknown (a standard error beside a number)."""
    return "" if error is None else f" +- {error:.{digits}f}"
