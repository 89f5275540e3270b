"""`agentrl run`: one driver composing a whole run (:mod:`.driver`), its options (:mod:`.config`), its stages
(:mod:`.stages`) and the processes it starts and stops (:mod:`.processes`)."""
