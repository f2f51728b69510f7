from charlie.cli import main

main()
