"""Tooling over compiled programs, apart from the runtime: HLO parsing (`hlo`), collective and
overlap analysis (`program`), the two-stream simulator (`simulate`), compile targets and
hardware numbers (`targets`, `hardware`), and XLA's own latency estimate (`xla_*`)."""
