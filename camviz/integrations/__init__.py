"""Adapters to training frameworks, each an optional extra imported only when used."""

__all__: list[str] = []
