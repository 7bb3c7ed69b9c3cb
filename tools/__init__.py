"""Programs about programs: compile and inspect a train step (`tools.inspection`), report and
draw it (`tools.report`), and time variants of it side by side (`tools.bench`)."""
