"""Hooks for the whole suite."""

from tests.skip_summary import pytest_terminal_summary

__all__ = ["pytest_terminal_summary"]
