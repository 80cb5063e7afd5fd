"""The layout of every command's --help: the flags a user needs first under "options", every other flag under
"expert options", and a usage line of the first alone.

A command names its first flags once (`add_command(..., common=...)`, default COMMON); a flag added anywhere
else lands among the expert options without further ado. The grouping happens when help is formatted, so it
sees every flag whatever order the command added them in.
"""

import argparse
import textwrap

PAIR = ("--drafter", "--target", "--device")
PROMPTS = ("--suite", "--prompts", "--limit", "--max-new-tokens")
OUTPUT = ("--out", "--json", "--config")
COMMON = (*PAIR, *PROMPTS, *OUTPUT)
EXPERT = "expert options"
# Stands for the expert options in a usage line (a required switch prints as its name).
EXPERT_USAGE = argparse.Action(option_strings=[f"[{EXPERT}]"], dest="expert_options", nargs=0, required=True)


def group_options(parser: argparse.ArgumentParser, common: tuple[str, ...]) -> None:
    """Order the flags of `common` (and -h) first under the parser's "options", in `common`'s order, and move
    every other flag into an "expert options" group, marked `expert` for the usage line. Once per parser."""
    if any(group.title == EXPERT for group in parser._action_groups):
        return
    rank = {flag: i for i, flag in enumerate(("-h", *common))}
    flags = [action for group in parser._action_groups if group is not parser._positionals
             for action in group._group_actions]
    first = sorted((action for action in flags if _rank(action, rank) is not None), key=lambda a: _rank(a, rank))
    expert = [action for action in flags if _rank(action, rank) is None]
    for group in parser._action_groups:
        if group is not parser._positionals:
            group._group_actions[:] = []
    parser._optionals._group_actions[:] = first
    for i, action in enumerate(first):
        action.help_rank = i
    if expert:
        parser.add_argument_group(EXPERT)._group_actions[:] = expert
    for action in expert:
        action.expert = True


def _rank(action, rank: dict) -> int | None:
    return min((rank[flag] for flag in action.option_strings if flag in rank), default=None)


def usage_actions(actions: list) -> list:
    """The actions a usage line lists, in the order of --help: the first flags, and one `[expert options]`
    for the others (before `group_options` ran: every action as it is)."""
    first = [action for action in actions if action.option_strings and not getattr(action, "expert", False)]
    if len(first) + sum(not action.option_strings for action in actions) == len(actions):
        return actions
    first.sort(key=lambda action: getattr(action, "help_rank", 0))
    return [*first, EXPERT_USAGE, *(action for action in actions if not action.option_strings)]


def fill_lines(text: str, width: int, indent: str) -> str:
    """`text` with each line wider than `width` wrapped on its own, so that paragraphs fill the terminal and
    example lines keep their breaks (an indented line continues 4 columns further in)."""
    lines = []
    for line in text.splitlines():
        lead = indent + line[:len(line) - len(line.lstrip())]
        more = "    " if line[:1].isspace() else ""
        lines.append(textwrap.fill(line.strip(), width, initial_indent=lead, subsequent_indent=lead + more,
                                   break_long_words=False, break_on_hyphens=False)
                     if len(indent + line) > width else indent + line)
    return "\n".join(lines)


def add_alias(parser: argparse.ArgumentParser, old: str, flag: str) -> None:
    """Let `old` (a former spelling) set what `flag` sets, hidden from --help, so that scripts keep working."""
    parser._option_string_actions[old] = parser._option_string_actions[flag]
