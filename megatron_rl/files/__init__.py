"""Files users bring and folders runs write: JSON and YAML read with bounds (`files/json_input.py`,
`files/yaml_input.py`), one run per output folder (`files/out_lock.py`) and what FlexFloor may replace or delete
(`files/owned_paths.py`)."""
