"""Reliability findings and fault cells: each test runs real processes and services on loopback."""
