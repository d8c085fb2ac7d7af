# torchrun's stderr with its own report folded (launch/train_multi_node.sh pipes it through this).
# A rank that refuses a setting or an input says one `error:` line and exits 2 or 1 (errors.py),
# and one stopped by a signal exits 128 + signal after its checkpoint; torchrun then adds its log
# lines and a ChildFailedError traceback of 15-40 lines that say nothing more. Those are dropped;
# a rank that died otherwise (killed, crashed) is said in one line. The ranks' own output, their
# tracebacks included, passes unchanged. The root cause's exit code is written to `codefile`, so
# the script can exit with it (torchrun's own status is 1 for any failure).
#   awk -v codefile=<path> -f launch/fold_torchrun_report.awk
{
  if (pending != "") {  # a traceback: torchrun's own when its first frame is the torchrun script
    if ($0 ~ /bin\/torchrun/) { report = 1; pending = ""; next }
    print pending; pending = ""
  }
  if (report) {
    if ($0 ~ /^Root Cause/) root = 1
    if (root && $1 == "rank" && $2 == ":") rank = $3
    if (root && $1 == "exitcode" && $2 == ":") code = $3
    if (root && $0 ~ /^====/) { report = 0; root = 0 }
    next
  }
  if ($0 == "Traceback (most recent call last):") { pending = $0; next }
  if ($0 ~ /^[IWE][0-9][0-9][0-9][0-9] [0-9:.]+ +[0-9]+ .*torch\/distributed\/elastic\//) next
  print; fflush()
}
END {
  if (pending != "") print pending
  if (code != "" && (code + 0 < 0 || (code != 1 && code != 2 && code + 0 < 128)))
    print "error: rank " rank " failed with exit code " code " (torchrun's report folded; a negative code is the signal that killed it)"
  if (codefile != "") print code > codefile
}
