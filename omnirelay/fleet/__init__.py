"""Fleet planning and autoscaling: how many workers of each role (:mod:`.planner`), and a loop that
keeps them there as load moves (:mod:`.autoscaler`) through a pluggable actuator (:mod:`.actuators`)."""
