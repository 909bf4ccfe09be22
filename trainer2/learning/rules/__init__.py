"""The learning rules (found by name through trainer2.components): what a batch runs after its free phase, and how
the gradient is formed from it. Each rule is one module: ep (centred, positive, negative), chl, coupled, rbp."""

from __future__ import annotations

from trainer2.learning.rules.rule import Rule, RuleConfig

__all__ = ["Rule", "RuleConfig"]
