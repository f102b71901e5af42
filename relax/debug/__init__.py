"""What a run checks about itself (conf/debug/): its plan, response health, the doctor's checks
in the loop (strict), weight checks, and layer dumps read and judged. The offline tools that read
a finished run are in relax/tools/."""
