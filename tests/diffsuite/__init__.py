"""The differential suite (issue 20): K3 spellings under backend="k3" against eager, step by step
over seeded request schedules. `driver.py` runs one cell; `test_diffsuite.py` lists the cells."""
