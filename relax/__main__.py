from relax.cli import main

main()
