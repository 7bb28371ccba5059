"""Reward models behind one protocol."""
