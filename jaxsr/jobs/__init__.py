"""Dataset jobs: configs, records, resume, progress, reports and exports."""
