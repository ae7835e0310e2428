"""Example trainers built on privkit's public API (Upcycled-FL, MAPA, SCFL, DP-REC).

Importing :mod:`privkit` never imports this package.
"""
