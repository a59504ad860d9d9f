"""`appliance eval`: retrieval (needle) and perplexity, exact vs block-sparse attention."""
from __future__ import annotations


def add_eval_parser(sub, add_engine_arguments) -> None:
    e = sub.add_parser("eval", help="needle retrieval and perplexity, exact vs sparse attention")
    kinds = e.add_subparsers(dest="eval_kind", metavar="KIND")
    kinds.required = True
    needle = kinds.add_parser("needle", help="recall of planted facts per context and sparse k")
    add_engine_arguments(needle)
    needle.set_defaults(func=_not_ready)
    ppl = kinds.add_parser("ppl", help="perplexity of a text file")
    add_engine_arguments(ppl)
    ppl.add_argument("--file", required=True)
    ppl.set_defaults(func=_not_ready)


def _not_ready(args) -> int:
    raise NotImplementedError("appliance eval is being written (long-context issue)")
