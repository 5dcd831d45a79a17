
#compdef pfctl

_pfctl_completion() {
  eval $(env _TYPER_COMPLETE_ARGS="${words[1,$CURRENT]}" _PFCTL_COMPLETE=complete_zsh pfctl)
}

compdef _pfctl_completion pfctl

