from favor.bench.cli import main

main()
