"""The `findoc` generator: a company's filing as data (pure, no tokenizer, no I/O).

Guarantees:
- `make_filing(rng)` draws a company: three fiscal years, three segments, an income
  statement, a segment table, a balance sheet and a cash-flow statement, one footnote that
  restates one segment's revenue for a prior year, and a peer company's figures. Every
  figure is an int number of tenths of a million dollars, so what a table shows (in
  millions, or in thousands) is exact, and every gold is computed from shown figures.
- The tables state their unit in their title; units differ between tables (the segment
  table is always in thousands, the balance sheet in thousands or millions).
- `filler(rng, filing, n)` is `n` narrative paragraphs (business, risk factors, MD&A) that
  speak of the same company, years and segments and carry numbers of their own (backlog,
  headcount, sites): filler is not separable from the figures by vocabulary.
- The same rng state gives the same filing, blocks and filler: no other source of randomness.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

COMPANIES = (
    "Halvorsen Industries",
    "Brightwater Holdings",
    "Kestrel Dynamics",
    "Marlow & Finch Group",
    "Oakridge Systems",
    "Veridian Manufacturing",
    "Castellan Technologies",
    "Pemberton Materials",
    "Ashgrove Networks",
    "Sorrento Biosciences",
)
SEGMENTS = ("Industrial", "Healthcare", "Software", "Energy", "Consumer", "Aerospace", "Logistics", "Materials")


@dataclass(frozen=True)
class Block:
    """One piece of the document: where it goes (`order`) and its text."""

    order: float
    text: str
    kind: str = "filler"


@dataclass
class Filing:
    """A company's figures, tenths of a million dollars, by line and year (and segment)."""

    company: str
    peer: str
    years: tuple[int, ...]
    segments: tuple[str, ...]
    seg_revenue: dict[tuple[str, int], int]
    seg_oi: dict[tuple[str, int], int]
    lines: dict[tuple[str, int], int]
    """Consolidated lines: revenue, cost_of_revenue, gross_profit, sga, corporate, operating_income,
    net_income, cash, total_assets, total_liabilities, total_equity, long_term_debt,
    operating_cash_flow, capex (negative), free_cash_flow."""
    peer_lines: dict[tuple[str, int], int]
    restated: tuple[str, int, int, int]
    """(segment, year, as originally reported, restated)."""
    bs_unit: str = "millions"
    markdown: bool = True
    extra: dict = field(default_factory=dict)

    def seg_rev(self, segment: str, year: int) -> int:
        """Segment revenue after the footnote's restatement."""
        seg, yr, _, new = self.restated
        return new if (segment, year) == (seg, yr) else self.seg_revenue[(segment, year)]


def money(tenths: int, unit: str = "millions") -> str:
    """A shown figure: `1,234.5` in millions, `1,234,500` in thousands, negatives in parentheses."""
    v = abs(tenths)
    text = f"{v // 10:,}.{v % 10}" if unit == "millions" else f"{v * 100:,}"
    return f"({text})" if tenths < 0 else text


def _series(rng: random.Random, start_lo: int, start_hi: int, years: int, drift: float) -> list[int]:
    out = [rng.randint(start_lo, start_hi)]
    for _ in range(years - 1):
        out.append(max(10, round(out[-1] * (1 + rng.uniform(-drift, drift * 1.5)))))
    return out


def _consolidated(rng: random.Random, years, segments, seg_revenue: dict, seg_oi: dict) -> dict[tuple[str, int], int]:
    """The consolidated lines of each year, from the segments' figures and a few drawn ratios."""
    lines: dict[tuple[str, int], int] = {}
    for y in years:
        rev = sum(seg_revenue[(s, y)] for s in segments)
        corporate = round(rev * rng.uniform(0.01, 0.03))
        oi = sum(seg_oi[(s, y)] for s in segments) - corporate
        sga = round(rev * rng.uniform(0.08, 0.15))
        gross = oi + sga
        net = round(oi * rng.uniform(0.70, 0.80))
        assets = round(rev * rng.uniform(1.1, 1.8))
        liabilities = round(assets * rng.uniform(0.35, 0.65))
        debt = round(liabilities * rng.uniform(0.3, 0.6))
        ocf = round(oi * rng.uniform(0.9, 1.4))
        capex = -round(rev * rng.uniform(0.03, 0.08))
        lines.update(
            {
                ("revenue", y): rev,
                ("cost_of_revenue", y): rev - gross,
                ("gross_profit", y): gross,
                ("sga", y): sga,
                ("corporate", y): corporate,
                ("operating_income", y): oi,
                ("net_income", y): net,
                ("cash", y): round(assets * rng.uniform(0.05, 0.15)),
                ("total_assets", y): assets,
                ("total_liabilities", y): liabilities,
                ("total_equity", y): assets - liabilities,
                ("long_term_debt", y): debt,
                ("operating_cash_flow", y): ocf,
                ("capex", y): capex,
                ("free_cash_flow", y): ocf + capex,
            }
        )
    return lines


def make_filing(rng: random.Random) -> Filing:
    """A company's filing (see the module guarantees)."""
    company, peer = rng.sample(COMPANIES, 2)
    last = rng.randint(2019, 2025)
    years = (last - 2, last - 1, last)
    segments = tuple(rng.sample(SEGMENTS, 3))
    seg_revenue, seg_oi = {}, {}
    for s in segments:
        revs = _series(rng, 2_000, 40_000, 3, 0.15)
        margin = rng.uniform(0.06, 0.28)
        for y, r in zip(years, revs):
            margin = min(0.35, max(0.02, margin + rng.uniform(-0.04, 0.04)))
            seg_revenue[(s, y)], seg_oi[(s, y)] = r, round(r * margin)
    lines = _consolidated(rng, years, segments, seg_revenue, seg_oi)
    peer_lines = {}
    for y in years:
        prev = lines[("revenue", y)]
        peer_lines[("revenue", y)] = round(prev * rng.uniform(0.6, 1.4))
        peer_lines[("operating_income", y)] = round(peer_lines[("revenue", y)] * rng.uniform(0.05, 0.25))
    seg, yr = rng.choice(segments), rng.choice(years[:2])
    old = seg_revenue[(seg, yr)]
    new = old + rng.choice((-1, 1)) * rng.randint(max(5, old // 50), max(10, old // 12))
    return Filing(
        company=company,
        peer=peer,
        years=years,
        segments=segments,
        seg_revenue=seg_revenue,
        seg_oi=seg_oi,
        lines=lines,
        peer_lines=peer_lines,
        restated=(seg, yr, old, new),
        bs_unit=rng.choice(("millions", "thousands")),
        markdown=rng.random() < 0.5,
    )


LABELS = {
    "revenue": "Revenue",
    "cost_of_revenue": "Cost of revenue",
    "gross_profit": "Gross profit",
    "sga": "Selling, general and administrative",
    "corporate": "Corporate expense",
    "operating_income": "Operating income",
    "net_income": "Net income",
    "cash": "Cash and cash equivalents",
    "total_assets": "Total assets",
    "total_liabilities": "Total liabilities",
    "total_equity": "Total shareholders' equity",
    "long_term_debt": "Long-term debt",
    "operating_cash_flow": "Net cash provided by operating activities",
    "capex": "Capital expenditures",
    "free_cash_flow": "Free cash flow",
}
TABLES = {
    "income": (
        "Consolidated Statements of Operations",
        ("revenue", "cost_of_revenue", "gross_profit", "sga", "corporate", "operating_income", "net_income"),
    ),
    "balance": (
        "Consolidated Balance Sheets",
        ("cash", "total_assets", "total_liabilities", "long_term_debt", "total_equity"),
    ),
    "cash": ("Consolidated Statements of Cash Flows", ("operating_cash_flow", "capex", "free_cash_flow")),
}
TABLE_ORDER = {"income": 50, "segments": 51, "balance": 52, "cash": 53, "note": 60, "peer": 70}


def table(f: Filing, title: str, rows: list[tuple[str, list[int]]], unit: str) -> str:
    """A table of rows over the filing's years, markdown or aligned plain text."""
    head = f"{title} (in {unit} of US dollars, fiscal years ended December 31)"
    cols = [str(y) for y in f.years]
    cells = [(label, [money(v, unit) for v in vals]) for label, vals in rows]
    if f.markdown:
        out = [f"### {head}", "", "| Line item | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
        out += ["| " + label + " | " + " | ".join(vs) + " |" for label, vs in cells]
        return "\n".join(out)
    width = max(len(label) for label, _ in cells) + 2
    out = [head.upper(), "", " " * width + "".join(c.rjust(14) for c in cols)]
    out += [label.ljust(width) + "".join(v.rjust(14) for v in vs) for label, vs in cells]
    return "\n".join(out)


def blocks(f: Filing) -> dict[str, Block]:
    """The filing's tables, footnote and peer comparison, by name."""
    out = {}
    for name, (title, keys) in TABLES.items():
        unit = f.bs_unit if name == "balance" else "millions"
        rows = [(LABELS[k], [f.lines[(k, y)] for y in f.years]) for k in keys]
        out[name] = Block(TABLE_ORDER[name], table(f, title, rows, unit), name)
    rows = []
    for s in f.segments:
        rows.append((f"{s} revenue", [f.seg_revenue[(s, y)] for y in f.years]))
        rows.append((f"{s} operating income", [f.seg_oi[(s, y)] for y in f.years]))
    out["segments"] = Block(TABLE_ORDER["segments"], table(f, "Segment Information", rows, "thousands"), "segments")
    seg, yr, old, new = f.restated
    out["note"] = Block(
        TABLE_ORDER["note"],
        f"Note 7 - Restatement of segment information. Following the transfer of a product line between "
        f"reporting units, {seg} segment revenue for fiscal {yr} has been restated from ${money(old)} million, "
        f"as originally reported, to ${money(new)} million. The Segment Information table above presents "
        f"fiscal {yr} as originally reported; the restated amount supersedes it. Consolidated revenue is unaffected, "
        f"as the difference was previously recorded in intersegment eliminations.",
        "note",
    )
    peer_rows = [(LABELS[k], [f.peer_lines[(k, y)] for y in f.years]) for k in ("revenue", "operating_income")]
    out["peer"] = Block(
        TABLE_ORDER["peer"],
        f"Peer comparison. The following figures of {f.peer}, a competitor, are taken from its public filings "
        f"and are shown for comparison only.\n\n"
        + table(f, f"{f.peer} - Selected Financial Data", peer_rows, "millions"),
        "peer",
    )
    return out


def header(f: Filing) -> Block:
    """The filing's title block."""
    return Block(
        0,
        f"{f.company} - Annual Report on Form 10-K for the fiscal year ended December 31, {f.years[-1]}\n\n"
        f"{f.company} reports three segments: {', '.join(f.segments)}.",
        "header",
    )


_OPENERS = (
    "Demand in our {seg} end markets was {adj} during fiscal {year}",
    "Our {seg} segment opened {n} new service sites in fiscal {year}",
    "Backlog in the {seg} segment stood at approximately ${m} million at the end of fiscal {year}",
    "Headcount in {seg} was about {n},{k:03d} employees at year end {year}",
    "Pricing actions in {seg} took effect in the {q} quarter of fiscal {year}",
    "Raw material costs affecting {seg} were {adj} in fiscal {year}",
)
_MIDDLES = (
    "as customers adjusted inventory levels and deferred some orders",
    "while supply chain constraints eased over the second half of the year",
    "and management expects these conditions to persist into the next fiscal year",
    "reflecting the integration of acquired businesses and ongoing restructuring",
    "although foreign currency movements offset part of the improvement",
    "which the Company addressed through productivity programs and sourcing changes",
)
_RISKS = (
    "Our results could be adversely affected by changes in interest rates and access to credit",
    "We depend on a limited number of suppliers for certain components used by {seg}",
    "Cybersecurity incidents could disrupt our operations and harm our reputation",
    "Changes in tax law in the jurisdictions where {company} operates could increase our effective tax rate",
    "Failure to retain key personnel in {seg} could impair our ability to execute our strategy",
    "Litigation and regulatory proceedings may result in significant costs",
)
_SECTIONS = (
    (10, "Item 1. Business"),
    (20, "Item 1A. Risk Factors"),
    (30, "Item 7. Management's Discussion and Analysis"),
)


def filler(rng: random.Random, f: Filing, n: int) -> list[Block]:
    """`n` narrative paragraphs spread over the business, risk and MD&A sections (see the module guarantees)."""
    out = [Block(order, f"## {title}", "section") for order, title in _SECTIONS]
    for i in range(n):
        section = _SECTIONS[i % 3][0]
        sentences = []
        for _ in range(rng.randint(3, 5)):
            words = dict(
                seg=rng.choice(f.segments),
                adj=rng.choice(("stable", "softer", "stronger", "mixed", "resilient", "uneven")),
                year=rng.choice(f.years),
                n=rng.randint(2, 60),
                k=rng.randint(0, 999),
                m=f"{rng.randint(100, 9000):,}.{rng.randint(0, 9)}",
                q=rng.choice(("first", "second", "third", "fourth")),
                company=f.company,
            )
            if section == 20:
                sentences.append(rng.choice(_RISKS).format(**words) + ".")
            else:
                sentences.append(f"{rng.choice(_OPENERS).format(**words)}, {rng.choice(_MIDDLES)}.")
        out.append(Block(section + (i + 1) / (n + 2), " ".join(sentences)))
    return out
